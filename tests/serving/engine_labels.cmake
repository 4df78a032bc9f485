# Read by ctest after the discovered gtest cases of this folder (TEST_INCLUDE_FILES, appended
# after gtest_discover_tests' own): the case that runs the reference engine on a downloaded model
# (SmolLM2: minutes of instrumented inference under ThreadSanitizer) gets the label `model` too,
# as the other model-running tests have it, so `-LE model` leaves it out. kvd_add_test labels a
# whole binary; this labels one case of it (its other label as in CMakeLists.txt).
set_tests_properties(CalibrationE2eTest.KvdctlCalibrateTokenisesATextCorpusForAGgufModel
                     PROPERTIES LABELS "serving;model")
