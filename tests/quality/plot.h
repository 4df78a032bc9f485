// A dependency-free PNG line plot of perplexity against p_c, one line per method, with a legend of
// method names (a built-in 3x5 font; the colours are also listed by PlotLegend and in
// results.md). The y range stops at 2.5x the engine's perplexity; higher points are triangles on
// the top edge, their value in the legend.
#pragma once

#include <string>
#include <vector>

#include "harness.h"

namespace kvd::quality {

// RGB colour of series i (cycled).
struct Rgb {
  unsigned char r, g, b;
};
Rgb SeriesColor(size_t i);
const char* SeriesColorName(size_t i);
bool SeriesDashed(size_t i);  // series past the palette's length are dashed (second cycle)

// Methods in plot order with their colour names, e.g. {"full: black", "sink_recent: red"}
// ("... dashed" for the second cycle of colours).
std::vector<std::string> PlotLegend(const HarnessReport& r);

// Encodes an RGB image (row-major, 3 bytes per pixel) as PNG. With `compress` and zlib in the
// build, IDAT is deflated by zlib; otherwise it holds stored (uncompressed) deflate blocks.
std::string EncodePng(int width, int height, const std::vector<unsigned char>& rgb,
                      bool compress = false);
// A zlib stream of stored deflate blocks (no compression) with its Adler-32.
std::string StoredZlib(const std::string& raw);

// Writes the plot to `path`. "full" (p_c 0 only) is drawn as a horizontal dashed line.
Status WritePerplexityPlot(const HarnessReport& r, const std::string& path);

// Writes the fronts of `mode` (fronts.h) to `path`: stored/raw (x, 0 to 1) against perplexity /
// engine (y, capped at 2.5), every row measured in bytes a grey dot, the dense front in blue and
// the compact front in red, each front point numbered; the legend names the numbered points.
Status WriteFrontPlot(const HarnessReport& r, const std::string& mode, const std::string& path);

}  // namespace kvd::quality
