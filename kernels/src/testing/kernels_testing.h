// What kernels_test reads of kvd_kernels' internals, behind one header so that the test's include
// path holds this folder only (target kvd_kernels_testing; not installed): the CUDA module's stage
// table (cuda::HasDeviceSteps, a seam only the test calls), the host image of a compact chunk
// that DeviceCompactChunk uploads (PackDeviceImage) and the CPU's many-row Hadamard rotation
// (checked bit for bit against the one-row definition the CUDA twin runs).
#pragma once

#include "../cpu/hadamard_rows.h"
#include "../device_serving_internal.h"
#include "../plan_device_internal.h"
