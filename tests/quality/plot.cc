#include "plot.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>

#ifdef KVD_QUALITY_HAVE_ZLIB
#include <zlib.h>
#endif

namespace kvd::quality {
namespace {

constexpr Rgb kPalette[] = {{0, 0, 0},      {220, 30, 30},   {30, 90, 220}, {20, 150, 40},
                            {230, 130, 0},  {140, 40, 170},  {0, 170, 170}, {120, 80, 40},
                            {240, 60, 160}, {110, 110, 110}, {170, 170, 0}, {0, 60, 110},
                            {250, 90, 60}};
constexpr const char* kPaletteNames[] = {"black",  "red",  "blue",  "green", "orange",
                                         "purple", "teal", "brown", "pink",  "grey",
                                         "olive",  "navy", "coral"};
constexpr size_t kPaletteSize = sizeof(kPalette) / sizeof(kPalette[0]);
static_assert(kPaletteSize == sizeof(kPaletteNames) / sizeof(kPaletteNames[0]));

uint32_t Crc32(const unsigned char* p, size_t n, uint32_t crc = 0) {
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

void Put32(std::string* s, uint32_t v) {
  for (int k = 3; k >= 0; --k) s->push_back(static_cast<char>((v >> (8 * k)) & 0xFF));
}

void Chunk(std::string* out, const char* type, const std::string& data) {
  Put32(out, static_cast<uint32_t>(data.size()));
  std::string body = std::string(type, 4) + data;
  out->append(body);
  Put32(out, Crc32(reinterpret_cast<const unsigned char*>(body.data()), body.size()));
}

// 3x5 digit glyphs (and '.'), rows top to bottom, 3 bits each (MSB left).
const uint8_t kGlyphs[11][5] = {{7, 5, 5, 5, 7}, {2, 6, 2, 2, 7}, {7, 1, 7, 4, 7}, {7, 1, 7, 1, 7},
                                {5, 5, 7, 1, 1}, {7, 4, 7, 1, 7}, {7, 4, 7, 5, 7}, {7, 1, 1, 1, 1},
                                {7, 5, 7, 5, 7}, {7, 5, 7, 1, 7}, {0, 0, 0, 0, 2}};

class Canvas {
 public:
  Canvas(int w, int h) : w_(w), h_(h), px_(static_cast<size_t>(w) * h * 3, 255) {}
  void Set(int x, int y, Rgb c) {
    if (x < 0 || y < 0 || x >= w_ || y >= h_) return;
    unsigned char* p = &px_[(static_cast<size_t>(y) * w_ + x) * 3];
    p[0] = c.r;
    p[1] = c.g;
    p[2] = c.b;
  }
  void Dot(int x, int y, Rgb c, int r) {
    for (int dy = -r; dy <= r; ++dy)
      for (int dx = -r; dx <= r; ++dx) Set(x + dx, y + dy, c);
  }
  void Line(double x0, double y0, double x1, double y1, Rgb c, int thick, bool dashed = false) {
    const int n = static_cast<int>(std::max(std::fabs(x1 - x0), std::fabs(y1 - y0))) + 1;
    for (int i = 0; i <= n; ++i) {
      if (dashed && (i / 8) % 2 == 1) continue;
      const double t = static_cast<double>(i) / n;
      Dot(static_cast<int>(std::lround(x0 + t * (x1 - x0))),
          static_cast<int>(std::lround(y0 + t * (y1 - y0))), c, thick / 2);
    }
  }
  // Digits and '.' at (x, y) top-left, scale s.
  void Text(int x, int y, const std::string& s, int scale, Rgb c) {
    for (char ch : s) {
      const int g = ch == '.' ? 10 : (ch >= '0' && ch <= '9' ? ch - '0' : -1);
      if (g >= 0) {
        for (int row = 0; row < 5; ++row)
          for (int col = 0; col < 3; ++col)
            if (kGlyphs[g][row] & (4 >> col))
              for (int a = 0; a < scale; ++a)
                for (int b = 0; b < scale; ++b) Set(x + col * scale + a, y + row * scale + b, c);
      }
      x += 4 * scale;
    }
  }
  const std::vector<unsigned char>& pixels() const { return px_; }

 private:
  int w_, h_;
  std::vector<unsigned char> px_;
};

}  // namespace

Rgb SeriesColor(size_t i) { return kPalette[i % kPaletteSize]; }
const char* SeriesColorName(size_t i) { return kPaletteNames[i % kPaletteSize]; }

std::vector<std::string> PlotLegend(const HarnessReport& r) {
  std::vector<std::string> names, out;
  for (const MethodResult& m : r.rows) {
    if (std::find(names.begin(), names.end(), m.method) == names.end()) names.push_back(m.method);
  }
  for (size_t i = 0; i < names.size(); ++i) out.push_back(names[i] + ": " + SeriesColorName(i));
  return out;
}

std::string EncodePng(int width, int height, const std::vector<unsigned char>& rgb, bool compress) {
  std::string raw;
  raw.reserve(static_cast<size_t>(height) * (width * 3 + 1));
  for (int y = 0; y < height; ++y) {
    raw.push_back('\0');  // filter: none
    raw.append(reinterpret_cast<const char*>(&rgb[static_cast<size_t>(y) * width * 3]), width * 3);
  }
  std::string z;
#ifdef KVD_QUALITY_HAVE_ZLIB
  if (compress) {
    uLongf len = compressBound(raw.size());
    z.resize(len);
    if (compress2(reinterpret_cast<Bytef*>(z.data()), &len,
                  reinterpret_cast<const Bytef*>(raw.data()), raw.size(), 9) == Z_OK) {
      z.resize(len);
    } else {
      z.clear();
    }
  }
#endif
  if (z.empty()) z = StoredZlib(raw);
  std::string png = "\x89PNG\r\n\x1a\n";
  std::string ihdr;
  Put32(&ihdr, static_cast<uint32_t>(width));
  Put32(&ihdr, static_cast<uint32_t>(height));
  ihdr += std::string("\x08\x02\x00\x00\x00", 5);  // 8-bit RGB, no interlace
  Chunk(&png, "IHDR", ihdr);
  Chunk(&png, "IDAT", z);
  Chunk(&png, "IEND", "");
  return png;
}

std::string StoredZlib(const std::string& raw) {
  // zlib stream of stored (uncompressed) deflate blocks.
  std::string z = "\x78\x01";
  for (size_t off = 0; off < raw.size() || off == 0;) {
    const size_t n = std::min<size_t>(65535, raw.size() - off);
    const bool last = off + n >= raw.size();
    z.push_back(static_cast<char>(last ? 1 : 0));
    z.push_back(static_cast<char>(n & 0xFF));
    z.push_back(static_cast<char>(n >> 8));
    z.push_back(static_cast<char>(~n & 0xFF));
    z.push_back(static_cast<char>((~n >> 8) & 0xFF));
    z.append(raw, off, n);
    off += n;
    if (last) break;
  }
  uint32_t a = 1, b = 0;
  for (unsigned char c : raw) {
    a = (a + c) % 65521;
    b = (b + a) % 65521;
  }
  Put32(&z, (b << 16) | a);
  return z;
}

Status WritePerplexityPlot(const HarnessReport& r, const std::string& path) {
  constexpr int W = 900, H = 560, L = 90, R = 30, T = 30, B = 60;
  Canvas cv(W, H);
  std::vector<std::string> names;
  std::map<std::string, std::vector<std::pair<double, double>>> series;
  double lo = r.engine_perplexity, hi = r.engine_perplexity;
  for (const MethodResult& m : r.rows) {
    if (std::find(names.begin(), names.end(), m.method) == names.end()) names.push_back(m.method);
    series[m.method].push_back({m.p_c, m.perplexity});
    if (std::isfinite(m.perplexity)) {
      lo = std::min(lo, m.perplexity);
      hi = std::max(hi, m.perplexity);
    }
  }
  if (!(hi > lo)) hi = lo + 1;
  const double pad = 0.05 * (hi - lo);
  lo -= pad;
  hi += pad;
  auto X = [&](double pc) { return L + pc * (W - L - R); };
  auto Y = [&](double ppl) { return H - B - (ppl - lo) / (hi - lo) * (H - T - B); };
  const Rgb axis{0, 0, 0}, grid{225, 225, 225};
  for (int i = 0; i <= 10; ++i) {  // x grid and ticks every 0.1
    cv.Line(X(i / 10.0), T, X(i / 10.0), H - B, grid, 1);
    char buf[8];
    std::snprintf(buf, sizeof(buf), "%.1f", i / 10.0);
    cv.Text(static_cast<int>(X(i / 10.0)) - 12, H - B + 10, buf, 2, axis);
  }
  for (int i = 0; i <= 5; ++i) {  // y grid and tick labels
    const double v = lo + (hi - lo) * i / 5.0;
    cv.Line(L, Y(v), W - R, Y(v), grid, 1);
    char buf[16];
    std::snprintf(buf, sizeof(buf), "%.1f", v);
    cv.Text(8, static_cast<int>(Y(v)) - 5, buf, 2, axis);
  }
  cv.Line(L, H - B, W - R, H - B, axis, 2);
  cv.Line(L, T, L, H - B, axis, 2);
  for (size_t i = 0; i < names.size(); ++i) {
    auto pts = series[names[i]];
    std::sort(pts.begin(), pts.end());
    const Rgb c = SeriesColor(i);
    if (pts.size() == 1) {  // "full": a reference level across the plot
      cv.Line(X(0), Y(pts[0].second), X(1), Y(pts[0].second), c, 2, /*dashed=*/true);
    }
    for (size_t k = 0; k < pts.size(); ++k) {
      if (!std::isfinite(pts[k].second)) continue;
      cv.Dot(static_cast<int>(X(pts[k].first)), static_cast<int>(Y(pts[k].second)), c, 4);
      if (k + 1 < pts.size() && std::isfinite(pts[k + 1].second)) {
        cv.Line(X(pts[k].first), Y(pts[k].second), X(pts[k + 1].first), Y(pts[k + 1].second), c, 3);
      }
    }
    // Legend swatch (colour order = PlotLegend order), top right.
    for (int dy = 0; dy < 12; ++dy)
      for (int dx = 0; dx < 24; ++dx)
        cv.Set(W - R - 30 + dx, T + 8 + static_cast<int>(i) * 18 + dy, c);
  }
  const std::string png = EncodePng(W, H, cv.pixels(), /*compress=*/true);
  std::ofstream out(path, std::ios::binary);
  out.write(png.data(), static_cast<std::streamsize>(png.size()));
  if (!out) return Status::Internal("cannot write " + path);
  return Status::Ok();
}

}  // namespace kvd::quality
