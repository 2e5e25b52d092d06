#include "analysis/heatmap.h"

#include <ATen/ATen.h>
#include <ft2build.h>
#include FT_FREETYPE_H
#include <fmt/format.h>
#include <png.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sys/stat.h>
#include <vector>

#include "common/error.h"

namespace dmi::analysis {

namespace {

// Where Debian's fonts-dejavu-core puts DejaVu Sans; DMI_FONT overrides.
const char* const kFontPaths[] = {"/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
                                  "/usr/share/fonts/TTF/DejaVuSans.ttf", "/usr/share/fonts/dejavu/DejaVuSans.ttf"};

std::vector<std::int32_t> codepoints(const std::string& s) {
  std::vector<std::int32_t> out;
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  utf8proc_ssize_t left = static_cast<utf8proc_ssize_t>(s.size());
  while (left > 0) {
    utf8proc_int32_t c = 0;
    utf8proc_ssize_t n = utf8proc_iterate(p, left, &c);
    if (n <= 0) {  // invalid UTF-8: one replacement character per byte
      c = 0xFFFD;
      n = 1;
    }
    out.push_back(c);
    p += n;
    left -= n;
  }
  return out;
}

// A glyph coverage bitmap of a string: 8-bit alpha, baseline at `ascent`.
struct Coverage {
  int w = 0, h = 0, ascent = 0;
  std::vector<std::uint8_t> a;
};

class Font {
 public:
  Font() {
    std::string path;
    if (const char* env = std::getenv("DMI_FONT"); env && *env) {
      path = env;
    } else {
      for (const char* p : kFontPaths) {
        struct stat st {};
        if (::stat(p, &st) == 0) {
          path = p;
          break;
        }
      }
    }
    DMI_CHECK(!path.empty(), "no font for the heatmap's labels: install fonts-dejavu-core (scripts/setup.sh), or set "
              "DMI_FONT to a .ttf file");
    DMI_CHECK(FT_Init_FreeType(&lib_) == 0, "FreeType did not initialise");
    if (FT_New_Face(lib_, path.c_str(), 0, &face_) != 0) {
      FT_Done_FreeType(lib_);
      DMI_FAIL("{}: FreeType cannot load this font (DMI_FONT must name a .ttf or .otf file)", path);
    }
  }
  ~Font() {
    FT_Done_Face(face_);
    FT_Done_FreeType(lib_);
  }
  Font(const Font&) = delete;
  Font& operator=(const Font&) = delete;

  int ascent(int px) { return size(px), static_cast<int>(face_->size->metrics.ascender >> 6); }
  int descent(int px) { return size(px), static_cast<int>(-(face_->size->metrics.descender >> 6)); }
  int width(const std::string& s, int px) {
    size(px);
    long w = 0;
    for (auto c : codepoints(s))
      if (FT_Load_Char(face_, static_cast<FT_ULong>(c), FT_LOAD_DEFAULT) == 0) w += face_->glyph->advance.x;
    return static_cast<int>((w + 63) >> 6);
  }
  Coverage render(const std::string& s, int px) {
    Coverage out;
    out.ascent = ascent(px);
    out.h = out.ascent + descent(px);
    out.w = std::max(1, width(s, px));
    out.a.assign(static_cast<std::size_t>(out.w) * out.h, 0);
    long pen = 0;
    for (auto c : codepoints(s)) {
      if (FT_Load_Char(face_, static_cast<FT_ULong>(c), FT_LOAD_RENDER) != 0) continue;
      const FT_GlyphSlot g = face_->glyph;
      const int x0 = static_cast<int>(pen >> 6) + g->bitmap_left, y0 = out.ascent - g->bitmap_top;
      for (unsigned r = 0; r < g->bitmap.rows; ++r)
        for (unsigned k = 0; k < g->bitmap.width; ++k) {
          const int x = x0 + static_cast<int>(k), y = y0 + static_cast<int>(r);
          if (x < 0 || y < 0 || x >= out.w || y >= out.h) continue;
          auto& dst = out.a[static_cast<std::size_t>(y) * out.w + x];
          dst = std::max(dst, g->bitmap.buffer[r * g->bitmap.pitch + k]);
        }
      pen += g->advance.x;
    }
    return out;
  }

 private:
  void size(int px) {
    if (px != px_) FT_Set_Pixel_Sizes(face_, 0, static_cast<FT_UInt>(px));
    px_ = px;
  }
  FT_Library lib_ = nullptr;
  FT_Face face_ = nullptr;
  int px_ = 0;
};

using Rgb = std::array<std::uint8_t, 3>;
enum class Anchor { start, middle, end };

// What the layout draws; the PNG and SVG writers render the same list.
struct Rect {
  int x, y, w, h;
  Rgb c;
};
struct Text {
  int x, y;  // the anchor point on the baseline
  std::string s;
  int px;
  Anchor anchor;
  bool vertical;  // reads bottom to top (rotated -90 degrees)
};
struct Drawing {
  int w = 0, h = 0;
  std::vector<Rect> rects;
  std::vector<Text> texts;
  int grid_x = 0, grid_y = 0, cell = 0, stride = 1;
};

const Rgb kInk{30, 30, 30};

std::string tick(double v) {
  std::string s = fmt::format("{:.2f}", v);
  while (s.size() > 1 && s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s == "-0" ? "0" : s;
}

Drawing lay_out(const Heatmap& h, Font& font) {
  at::Tensor x = h.values.to(at::kFloat).contiguous();
  DMI_CHECK(x.dim() == 2 && x.size(0) > 0 && x.size(1) > 0, "a heatmap needs a non-empty [rows, cols] matrix");
  const int R = static_cast<int>(x.size(0)), C = static_cast<int>(x.size(1));
  DMI_CHECK(h.row_labels.empty() || h.row_labels.size() == static_cast<std::size_t>(R), "{} row labels for {} rows",
            h.row_labels.size(), R);
  DMI_CHECK(h.col_labels.empty() || h.col_labels.size() == static_cast<std::size_t>(C),
            "{} column labels for {} columns", h.col_labels.size(), C);
  Drawing d;
  const int label_px = 11, axis_px = 12, title_px = 15, sub_px = 11;
  d.cell = std::clamp(640 / std::max(R, C), 3, 32);
  // Labels at least label_px + 2 pixels apart: every k-th when cells are small.
  const int stride = (label_px + 2 + d.cell - 1) / d.cell;
  d.stride = stride;
  auto row_label = [&](int r) { return h.row_labels.empty() ? std::to_string(r) : h.row_labels[r]; };
  auto col_label = [&](int c) { return h.col_labels.empty() ? std::to_string(c) : h.col_labels[c]; };
  int row_w = 0, col_w = 0;
  for (int r = 0; r < R; r += stride) row_w = std::max(row_w, font.width(row_label(r), label_px));
  for (int c = 0; c < C; c += stride) col_w = std::max(col_w, font.width(col_label(c), label_px));
  const int gw = C * d.cell, gh = R * d.cell;
  const int axis_h = font.ascent(axis_px) + font.descent(axis_px);
  const int title_w = std::max(font.width(h.title, title_px), font.width(h.subtitle, sub_px));
  const int top = 12 + font.ascent(title_px) + font.descent(title_px) + (h.subtitle.empty() ? 0 : axis_h) + 10;
  const int left = 10 + (h.row_axis.empty() ? 0 : axis_h + 6) + row_w + 6;
  d.grid_x = left;
  d.grid_y = top;
  // Colour bar: as tall as the grid (at least 120 px), ticks at both ends and the middle.
  const double lo = h.map == Colormap::sequential ? 0.0 : -1.0, hi = 1.0;
  const int bar_x = left + gw + 18, bar_w = 14, bar_h = std::max(gh, 120);
  int tick_w = 0;
  for (double v : {lo, (lo + hi) / 2, hi}) tick_w = std::max(tick_w, font.width(tick(v), label_px));
  const int right = 18 + bar_w + 5 + tick_w + (h.value_name.empty() ? 0 : 8 + axis_h) + 12;
  const int bottom = 6 + col_w + (h.col_axis.empty() ? 0 : 8 + axis_h) + 12;
  d.w = std::max(left + gw + right, 20 + title_w + 20);
  d.h = top + std::max(gh + bottom, bar_h + 16);
  d.rects.push_back({0, 0, d.w, d.h, {255, 255, 255}});

  // Title and subtitle.
  int y = 12 + font.ascent(title_px);
  d.texts.push_back({d.w / 2, y, h.title, title_px, Anchor::middle, false});
  if (!h.subtitle.empty()) d.texts.push_back({d.w / 2, y + axis_h + 2, h.subtitle, sub_px, Anchor::middle, false});
  // Cells.
  const float* p = x.data_ptr<float>();
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      Rgb rgb;
      heatmap_colour(p[static_cast<std::size_t>(r) * C + c], h.map, rgb.data());
      d.rects.push_back({left + c * d.cell, top + r * d.cell, d.cell, d.cell, rgb});
    }
  // Tick labels (centred on their cell) and axis titles.
  const int half = font.ascent(label_px) * 2 / 5;  // half a lower-case letter: centres text on a line
  for (int r = 0; r < R; r += stride)
    d.texts.push_back({left - 5, top + r * d.cell + d.cell / 2 + half, row_label(r), label_px, Anchor::end, false});
  for (int c = 0; c < C; c += stride)
    d.texts.push_back({left + c * d.cell + d.cell / 2 + half, top + gh + 5, col_label(c), label_px, Anchor::end, true});
  if (!h.row_axis.empty())
    d.texts.push_back({10 + font.ascent(axis_px), top + gh / 2, h.row_axis, axis_px, Anchor::middle, true});
  if (!h.col_axis.empty())
    d.texts.push_back({left + gw / 2, top + gh + 6 + col_w + 8 + font.ascent(axis_px), h.col_axis, axis_px,
                       Anchor::middle, false});
  // Colour bar, top = hi.
  const int steps = std::min(bar_h, 128);
  for (int i = 0; i < steps; ++i) {
    const int y0 = top + i * bar_h / steps, y1 = top + (i + 1) * bar_h / steps;
    Rgb rgb;
    heatmap_colour(hi - (hi - lo) * (i + 0.5) / steps, h.map, rgb.data());
    d.rects.push_back({bar_x, y0, bar_w, y1 - y0, rgb});
  }
  for (int i = 0; i < 3; ++i) {
    const double v = hi - (hi - lo) * i / 2.0;
    const int ty = top + bar_h * i / 2;
    d.rects.push_back({bar_x + bar_w, ty, 4, 1, kInk});
    d.texts.push_back({bar_x + bar_w + 6, ty + half, tick(v), label_px, Anchor::start, false});
  }
  if (!h.value_name.empty())
    d.texts.push_back({bar_x + bar_w + 6 + tick_w + 8 + font.ascent(axis_px), top + bar_h / 2, h.value_name, axis_px,
                       Anchor::middle, true});
  return d;
}

void write_png(const std::string& path, const Drawing& d, Font& font) {
  std::vector<std::uint8_t> img(static_cast<std::size_t>(d.w) * d.h * 3, 255);
  for (const auto& r : d.rects)
    for (int y = std::max(0, r.y); y < std::min(d.h, r.y + r.h); ++y)
      for (int x = std::max(0, r.x); x < std::min(d.w, r.x + r.w); ++x)
        std::copy(r.c.begin(), r.c.end(), &img[(static_cast<std::size_t>(y) * d.w + x) * 3]);
  for (const auto& t : d.texts) {
    const Coverage cov = font.render(t.s, t.px);
    const int offset = t.anchor == Anchor::start ? 0 : t.anchor == Anchor::middle ? cov.w / 2 : cov.w;
    for (int j = 0; j < cov.h; ++j)
      for (int i = 0; i < cov.w; ++i) {
        const int a = cov.a[static_cast<std::size_t>(j) * cov.w + i];
        if (!a) continue;
        const int u = i - offset, v = j - cov.ascent;
        const int x = t.vertical ? t.x + v : t.x + u, y = t.vertical ? t.y - u : t.y + v;
        if (x < 0 || y < 0 || x >= d.w || y >= d.h) continue;
        std::uint8_t* px = &img[(static_cast<std::size_t>(y) * d.w + x) * 3];
        for (int k = 0; k < 3; ++k) px[k] = static_cast<std::uint8_t>((px[k] * (255 - a) + kInk[k] * a + 127) / 255);
      }
  }
  FILE* fp = std::fopen(path.c_str(), "wb");
  DMI_CHECK(fp, "{}: cannot write PNG", path);
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    std::fclose(fp);
    DMI_FAIL("{}: writing PNG failed", path);
  }
  png_init_io(png, fp);
  png_set_IHDR(png, info, d.w, d.h, 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int y = 0; y < d.h; ++y) png_write_row(png, &img[static_cast<std::size_t>(y) * d.w * 3]);
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  DMI_CHECK(std::fclose(fp) == 0, "{}: writing PNG failed (disk full?)", path);
}

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

void write_svg(const std::string& path, const Drawing& d) {
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"DejaVu Sans, Verdana, sans-serif\" fill=\"rgb(30,30,30)\">\n<g shape-rendering=\"crispEdges\">\n",
      d.w, d.h);
  for (const auto& r : d.rects)
    s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"#{:02x}{:02x}{:02x}\"/>\n", r.x, r.y,
                     r.w, r.h, r.c[0], r.c[1], r.c[2]);
  s += "</g>\n";
  for (const auto& t : d.texts) {
    const char* anchor = t.anchor == Anchor::start ? "start" : t.anchor == Anchor::middle ? "middle" : "end";
    s += t.vertical ? fmt::format("<text transform=\"translate({},{}) rotate(-90)\" font-size=\"{}\" "
                                  "text-anchor=\"{}\" xml:space=\"preserve\">{}</text>\n",
                                  t.x, t.y, t.px, anchor, xml_escape(t.s))
                    : fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"{}\" text-anchor=\"{}\" "
                                  "xml:space=\"preserve\">{}</text>\n",
                                  t.x, t.y, t.px, anchor, xml_escape(t.s));
  }
  s += "</svg>\n";
  std::ofstream f(path, std::ios::binary);
  DMI_CHECK(f, "{}: cannot write SVG", path);
  f << s;
  f.close();
  DMI_CHECK(f, "{}: writing SVG failed (disk full?)", path);
}

bool ends_with(const std::string& s, const std::string& e) {
  return s.size() >= e.size() && std::equal(e.rbegin(), e.rend(), s.rbegin(),
                                            [](char a, char b) { return std::tolower(a) == std::tolower(b); });
}

}  // namespace

// Five anchors of matplotlib's viridis (sequential) or coolwarm (diverging),
// interpolated linearly.
void heatmap_colour(double v, Colormap map, std::uint8_t* rgb) {
  static const double viridis[5][3] = {{68, 1, 84}, {59, 82, 139}, {33, 145, 140}, {94, 201, 98}, {253, 231, 37}};
  static const double coolwarm[5][3] = {{59, 76, 192}, {141, 176, 254}, {221, 221, 221}, {244, 154, 123}, {180, 4, 38}};
  const auto& k = map == Colormap::sequential ? viridis : coolwarm;
  if (map == Colormap::diverging) v = (v + 1.0) / 2.0;
  if (!std::isfinite(v)) {
    rgb[0] = rgb[1] = rgb[2] = 0;
    return;
  }
  v = std::min(1.0, std::max(0.0, v)) * 4.0;
  const int i = std::min(3, static_cast<int>(v));
  const double t = v - i;
  for (int c = 0; c < 3; ++c) rgb[c] = static_cast<std::uint8_t>(std::lround(k[i][c] + t * (k[i + 1][c] - k[i][c])));
}

std::string axis_label(const std::string& token, std::size_t max_chars) {
  auto cps = codepoints(token);
  const bool cut = cps.size() > max_chars;
  if (cut) cps.resize(max_chars > 0 ? max_chars - 1 : 0);
  std::string out;
  for (auto c : cps) {
    std::string piece;
    if (c == '\n') piece = "\\n";
    else if (c == '\t') piece = "\\t";
    else if (c == '\r') piece = "\\r";
    else if (c < 0x20 || c == 0x7f) piece = fmt::format("\\x{:02x}", c);
    else if (c == ' ') piece = "\xc2\xb7";  // · : spaces stay visible
    else {
      utf8proc_uint8_t buf[4];
      const auto n = utf8proc_encode_char(c, buf);
      piece.assign(reinterpret_cast<const char*>(buf), static_cast<std::size_t>(n));
    }
    out += piece;
  }
  return cut ? out + "\xe2\x80\xa6" : out;  // …
}

HeatmapGeometry write_heatmap(const std::string& path, const Heatmap& h) {
  const bool svg = ends_with(path, ".svg");
  DMI_CHECK(svg || ends_with(path, ".png"), "{}: a heatmap is written as .png or .svg", path);
  Font font;
  const Drawing d = lay_out(h, font);
  if (svg) write_svg(path, d);
  else write_png(path, d, font);
  return {d.w, d.h, d.grid_x, d.grid_y, d.cell, d.stride};
}

}  // namespace dmi::analysis
