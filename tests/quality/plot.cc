#include "plot.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>

#include "fronts.h"

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

// 3x5 glyphs, rows top to bottom, 3 bits each (MSB left): digits, '.', the letters (drawn as
// capitals, for upper and lower case) and "_+-:,()/".
const uint8_t kDigits[10][5] = {{7, 5, 5, 5, 7}, {2, 6, 2, 2, 7}, {7, 1, 7, 4, 7}, {7, 1, 7, 1, 7},
                                {5, 5, 7, 1, 1}, {7, 4, 7, 1, 7}, {7, 4, 7, 5, 7}, {7, 1, 1, 1, 1},
                                {7, 5, 7, 5, 7}, {7, 5, 7, 1, 7}};
const uint8_t kLetters[26][5] = {{2, 5, 7, 5, 5}, {6, 5, 6, 5, 6}, {3, 4, 4, 4, 3}, {6, 5, 5, 5, 6},
                                 {7, 4, 6, 4, 7}, {7, 4, 6, 4, 4}, {3, 4, 5, 5, 3}, {5, 5, 7, 5, 5},
                                 {7, 2, 2, 2, 7}, {1, 1, 1, 5, 2}, {5, 5, 6, 5, 5}, {4, 4, 4, 4, 7},
                                 {5, 7, 7, 5, 5}, {6, 5, 5, 5, 5}, {2, 5, 5, 5, 2}, {6, 5, 6, 4, 4},
                                 {2, 5, 5, 6, 3}, {6, 5, 6, 5, 5}, {3, 4, 2, 1, 6}, {7, 2, 2, 2, 2},
                                 {5, 5, 5, 5, 7}, {5, 5, 5, 2, 2}, {5, 5, 7, 7, 5}, {5, 5, 2, 5, 5},
                                 {5, 5, 2, 2, 2}, {7, 1, 2, 4, 7}};

// The glyph of `ch`, or nullptr (drawn as a space).
const uint8_t* Glyph(char ch) {
  static const uint8_t kDot[5] = {0, 0, 0, 0, 2}, kUnderscore[5] = {0, 0, 0, 0, 7},
                       kPlus[5] = {0, 2, 7, 2, 0}, kMinus[5] = {0, 0, 7, 0, 0},
                       kColon[5] = {0, 2, 0, 2, 0}, kComma[5] = {0, 0, 0, 2, 4},
                       kOpen[5] = {1, 2, 2, 2, 1}, kClose[5] = {4, 2, 2, 2, 4},
                       kSlash[5] = {1, 1, 2, 4, 4};
  if (ch >= '0' && ch <= '9') return kDigits[ch - '0'];
  if (ch >= 'a' && ch <= 'z') return kLetters[ch - 'a'];
  if (ch >= 'A' && ch <= 'Z') return kLetters[ch - 'A'];
  switch (ch) {
    case '.':
      return kDot;
    case '_':
      return kUnderscore;
    case '+':
      return kPlus;
    case '-':
      return kMinus;
    case ':':
      return kColon;
    case ',':
      return kComma;
    case '(':
      return kOpen;
    case ')':
      return kClose;
    case '/':
      return kSlash;
    default:
      return nullptr;
  }
}

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
  // Text at (x, y) top-left, scale s (Glyph's characters; others leave a space).
  void Text(int x, int y, const std::string& s, int scale, Rgb c) {
    for (char ch : s) {
      if (const uint8_t* g = Glyph(ch)) {
        for (int row = 0; row < 5; ++row)
          for (int col = 0; col < 3; ++col)
            if (g[row] & (4 >> col))
              for (int a = 0; a < scale; ++a)
                for (int b = 0; b < scale; ++b) Set(x + col * scale + a, y + row * scale + b, c);
      }
      x += 4 * scale;
    }
  }
  // An upward triangle whose tip is at (x, y): a value above the plotted range.
  void UpTriangle(int x, int y, Rgb c, int size) {
    for (int dy = 0; dy < size; ++dy)
      for (int dx = -dy; dx <= dy; ++dx) Set(x + dx, y + dy, c);
  }
  const std::vector<unsigned char>& pixels() const { return px_; }

 private:
  int w_, h_;
  std::vector<unsigned char> px_;
};

// Six y grid lines from lo to hi with their values (printf `fmt`) left of the plot area
// [left, right] x [top, bottom], then the x and y axes; Y maps a value to its pixel row.
template <typename YMap>
void DrawYGridAndAxes(Canvas& cv, int left, int right, int top, int bottom, double lo, double hi,
                      const char* fmt, YMap Y) {
  const Rgb axis{0, 0, 0}, grid{225, 225, 225};
  for (int i = 0; i <= 5; ++i) {
    const double v = lo + (hi - lo) * i / 5.0;
    cv.Line(left, Y(v), right, Y(v), grid, 1);
    char buf[16];
    std::snprintf(buf, sizeof(buf), fmt, v);
    cv.Text(8, static_cast<int>(Y(v)) - 5, buf, 2, axis);
  }
  cv.Line(left, bottom, right, bottom, axis, 2);
  cv.Line(left, top, left, bottom, axis, 2);
}

}  // namespace

Rgb SeriesColor(size_t i) { return kPalette[i % kPaletteSize]; }
const char* SeriesColorName(size_t i) { return kPaletteNames[i % kPaletteSize]; }
bool SeriesDashed(size_t i) { return (i / kPaletteSize) % 2 == 1; }

std::vector<std::string> PlotLegend(const HarnessReport& r) {
  std::vector<std::string> names, out;
  for (const MethodResult& m : r.rows) {
    if (std::find(names.begin(), names.end(), m.method) == names.end()) names.push_back(m.method);
  }
  for (size_t i = 0; i < names.size(); ++i) {
    out.push_back(names[i] + ": " + SeriesColorName(i) + (SeriesDashed(i) ? " dashed" : ""));
  }
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
  // Plot area on the left, legend (swatch + method name) on the right.
  constexpr int W = 1280, H = 620, L = 90, R = 400, T = 50, B = 60;
  Canvas cv(W, H);
  std::vector<std::string> names;
  std::map<std::string, std::vector<std::pair<double, double>>> series;
  std::string mode;
  for (const MethodResult& m : r.rows) {
    if (std::find(names.begin(), names.end(), m.method) == names.end()) names.push_back(m.method);
    series[m.method].push_back({m.p_c, m.perplexity});
    if (m.method != "full") mode = m.mode;
  }
  // The y range holds every point up to kMaxRatio x the engine's perplexity; points above it
  // (KVSlimmer alone reaches x9) are drawn as triangles on the top edge, so that one collapsing
  // method does not squash the others into a band.
  constexpr double kMaxRatio = 2.5;
  const double cap = r.engine_perplexity > 0 ? kMaxRatio * r.engine_perplexity : INFINITY;
  double lo = r.engine_perplexity, hi = r.engine_perplexity;
  for (const MethodResult& m : r.rows) {
    if (std::isfinite(m.perplexity) && m.perplexity <= cap) {
      lo = std::min(lo, m.perplexity);
      hi = std::max(hi, m.perplexity);
    }
  }
  if (!(hi > lo)) hi = lo + 1;
  const double pad = 0.05 * (hi - lo);
  lo -= pad;
  hi += pad;
  // x from the tenth below the lowest ratio to 1 ("full", at p_c 0, is the level line).
  double x0 = 1;
  for (const MethodResult& m : r.rows) {
    if (m.method != "full") x0 = std::min(x0, m.p_c);
  }
  x0 = x0 >= 1 ? 0 : std::max(0.0, std::floor(x0 * 10 - 0.5) / 10);
  const int right = W - R;
  auto X = [&](double pc) { return L + (std::max(pc, x0) - x0) / (1 - x0) * (right - L); };
  auto Y = [&](double ppl) { return H - B - (std::min(ppl, hi) - lo) / (hi - lo) * (H - T - B); };
  const Rgb axis{0, 0, 0}, grid{225, 225, 225};
  cv.Text(L, 14,
          "perplexity against p_c, " + (mode.empty() ? std::string("one-shot") : mode) +
              " (full: the level)",
          3, axis);
  for (int i = static_cast<int>(std::lround(x0 * 20)); i <= 20; ++i) {  // x grid every 0.05
    cv.Line(X(i / 20.0), T, X(i / 20.0), H - B, grid, 1);
    char buf[8];
    std::snprintf(buf, sizeof(buf), "%.2f", i / 20.0);
    cv.Text(static_cast<int>(X(i / 20.0)) - 16, H - B + 10, buf, 2, axis);
  }
  cv.Text((L + right) / 2 - 30, H - B + 32, "p_c", 3, axis);
  DrawYGridAndAxes(cv, L, right, T, H - B, lo, hi, "%.1f", Y);
  for (size_t i = 0; i < names.size(); ++i) {
    auto pts = series[names[i]];
    std::sort(pts.begin(), pts.end());
    const Rgb c = SeriesColor(i);
    const bool dashed = SeriesDashed(i);
    if (pts.size() == 1) {  // "full": a reference level across the plot
      cv.Line(X(x0), Y(pts[0].second), X(1), Y(pts[0].second), c, 2, /*dashed=*/true);
    }
    for (size_t k = 0; k < pts.size() && pts.size() > 1; ++k) {
      if (!std::isfinite(pts[k].second)) continue;
      const int px = static_cast<int>(X(pts[k].first)), py = static_cast<int>(Y(pts[k].second));
      if (pts[k].second > hi) {
        cv.UpTriangle(px, py, c, 7);
      } else {
        cv.Dot(px, py, c, 4);
      }
      if (k + 1 < pts.size() && std::isfinite(pts[k + 1].second)) {
        cv.Line(X(pts[k].first), Y(pts[k].second), X(pts[k + 1].first), Y(pts[k + 1].second), c, 3,
                dashed);
      }
    }
    // Legend (colour order = PlotLegend order): a swatch line and the name, top right.
    const int ly = T + static_cast<int>(i) * 22;
    cv.Line(right + 20, ly + 5, right + 50, ly + 5, c, 3, dashed || pts.size() == 1);
    std::string label = names[i];
    for (const auto& [pc, ppl] : pts) {
      if (ppl > hi) {
        char buf[32];
        std::snprintf(buf, sizeof(buf), " (off scale: %.0f at %.2f)", ppl, pc);
        label += buf;
        break;
      }
    }
    cv.Text(right + 58, ly, label, 2, c);
  }
  const std::string png = EncodePng(W, H, cv.pixels(), /*compress=*/true);
  std::ofstream out(path, std::ios::binary);
  out.write(png.data(), static_cast<std::streamsize>(png.size()));
  if (!out) return Status::Internal("cannot write " + path);
  return Status::Ok();
}

Status WriteFrontPlot(const HarnessReport& r, const std::string& mode, const std::string& path) {
  constexpr int W = 1280, H = 620, L = 90, R = 400, T = 50, B = 60;
  constexpr double kMaxRatio = 2.5;
  Canvas cv(W, H);
  const double e = r.engine_perplexity > 0 ? r.engine_perplexity : 1.0;
  double lo = 1.0, hi = 1.0;
  for (const MethodResult& m : r.rows) {
    if (m.stored_raw < 0 || !std::isfinite(m.perplexity)) continue;
    lo = std::min(lo, m.perplexity / e);
    hi = std::max(hi, std::min(kMaxRatio, m.perplexity / e));
  }
  const double pad = 0.05 * (hi - lo + 1e-3);
  lo -= pad;
  hi += pad;
  const int right = W - R;
  auto X = [&](double x) { return L + std::clamp(x, 0.0, 1.05) / 1.05 * (right - L); };
  auto Y = [&](double y) { return H - B - (std::min(y, hi) - lo) / (hi - lo) * (H - T - B); };
  const Rgb axis{0, 0, 0}, grid{225, 225, 225}, grey{170, 170, 170};
  const Rgb colors[2] = {{30, 90, 220}, {220, 30, 30}};
  cv.Text(L, 14, "perplexity per stored byte, " + mode + " (dense: blue, compact: red)", 3, axis);
  for (int i = 0; i <= 10; ++i) {
    cv.Line(X(i / 10.0), T, X(i / 10.0), H - B, grid, 1);
    char buf[8];
    std::snprintf(buf, sizeof(buf), "%.1f", i / 10.0);
    cv.Text(static_cast<int>(X(i / 10.0)) - 10, H - B + 10, buf, 2, axis);
  }
  cv.Text((L + right) / 2 - 60, H - B + 32, "stored/raw", 3, axis);
  DrawYGridAndAxes(cv, L, right, T, H - B, lo, hi, "%.2f", Y);
  for (const MethodResult& m : r.rows) {
    if (m.stored_raw < 0 || (m.mode != mode && m.method != "full")) continue;
    cv.Dot(static_cast<int>(X(m.stored_raw)), static_cast<int>(Y(m.perplexity / e)), grey, 2);
  }
  int number = 0, ly = T;
  for (ServingForm form : {ServingForm::kDense, ServingForm::kCompact}) {
    const Rgb c = colors[form == ServingForm::kDense ? 0 : 1];
    const std::vector<size_t> front = ParetoFront(r, mode, form);
    for (size_t i = 0; i < front.size(); ++i) {
      const MethodResult& m = r.rows[front[i]];
      const double x = m.stored_raw, y = m.perplexity / e;
      if (i + 1 < front.size()) {
        const MethodResult& n = r.rows[front[i + 1]];
        cv.Line(X(x), Y(y), X(n.stored_raw), Y(n.perplexity / e), c, 2,
                form == ServingForm::kCompact);
      }
      const int px = static_cast<int>(X(x)), py = static_cast<int>(Y(y));
      if (y > hi) {
        cv.UpTriangle(px, py, c, 7);
      } else {
        cv.Dot(px, py, c, 4);
      }
      ++number;
      cv.Text(px + 6, py + (form == ServingForm::kDense ? -14 : 6), std::to_string(number), 2, c);
      char label[128];
      std::snprintf(label, sizeof(label), "%d %s %.2f: %.3f, %.3f", number, m.method.c_str(), m.p_c,
                    x, y);
      if (ly < H - 20) cv.Text(right + 20, ly, label, 2, c);
      ly += 18;
    }
  }
  const std::string png = EncodePng(W, H, cv.pixels(), /*compress=*/true);
  std::ofstream out(path, std::ios::binary);
  out.write(png.data(), static_cast<std::streamsize>(png.size()));
  if (!out) return Status::Internal("cannot write " + path);
  return Status::Ok();
}

}  // namespace kvd::quality
