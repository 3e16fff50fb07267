#include "viz/svg.hpp"

#include <cmath>
#include <cstdio>

#include "core/error.hpp"

namespace treecp::viz {

std::string xml_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string px(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", std::abs(v) < 0.005 ? 0.0 : v);
  std::string s = buf;
  while (s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s;
}

std::string value(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

Svg::Svg(double width, double height) {
  out_ = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  out_ += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + px(width) + "\" height=\"" + px(height) +
          "\" viewBox=\"0 0 " + px(width) + " " + px(height) +
          "\" font-family=\"DejaVu Sans, Verdana, Arial, sans-serif\">\n";
  open_.push_back("svg");
}

namespace {

void append_attrs(std::string& out, const Attrs& attrs) {
  for (const auto& [name, val] : attrs) out += " " + name + "=\"" + xml_escape(val) + "\"";
}

}  // namespace

void Svg::open(const std::string& tag, const Attrs& attrs) {
  out_ += "<" + tag;
  append_attrs(out_, attrs);
  out_ += ">\n";
  open_.push_back(tag);
}

void Svg::close() {
  require(open_.size() > 1, "svg: close() without an open element");
  out_ += "</" + open_.back() + ">\n";
  open_.pop_back();
}

void Svg::element(const std::string& tag, const Attrs& attrs, std::string_view text, std::string_view tooltip) {
  out_ += "<" + tag;
  append_attrs(out_, attrs);
  if (text.empty() && tooltip.empty()) {
    out_ += "/>\n";
    return;
  }
  out_ += ">";
  if (!tooltip.empty()) out_ += "<title>" + xml_escape(tooltip) + "</title>";
  out_ += xml_escape(text) + "</" + tag + ">\n";
}

void Svg::defs(std::string_view markup) {
  out_ += "<defs>";
  out_ += markup;
  out_ += "</defs>\n";
}

std::string Svg::finish() {
  require(open_.size() == 1, "svg: ", open_.size() - 1, " element(s) left open");
  out_ += "</svg>\n";
  open_.clear();
  return std::move(out_);
}

std::string rank_colour(int rank) {
  static const char* const kTableau[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                                         "#edc948", "#b07aa1", "#ff9da7", "#9c755f"};
  constexpr int kNamed = sizeof kTableau / sizeof kTableau[0];
  if (rank >= 0 && rank < kNamed) return kTableau[rank];
  // HSL with the hue stepped by the golden angle, so neighbours differ; saturation and lightness fixed.
  const double h = std::fmod(rank * 137.508, 360.0) / 60.0, s = 0.55, l = 0.55;
  const double c = (1 - std::abs(2 * l - 1)) * s, x = c * (1 - std::abs(std::fmod(h, 2.0) - 1)), m = l - c / 2;
  double r = 0, g = 0, b = 0;
  switch (static_cast<int>(h)) {
    case 0: r = c, g = x; break;
    case 1: r = x, g = c; break;
    case 2: g = c, b = x; break;
    case 3: g = x, b = c; break;
    case 4: r = x, b = c; break;
    default: r = c, b = x;
  }
  char buf[8];
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x", static_cast<int>(std::lround((r + m) * 255)),
                static_cast<int>(std::lround((g + m) * 255)), static_cast<int>(std::lround((b + m) * 255)));
  return buf;
}

std::string lighten(const std::string& hex, double amount) {
  require(hex.size() == 7 && hex[0] == '#', "lighten: expected #rrggbb, got '", hex, "'");
  char buf[8];
  int rgb[3];
  for (int i = 0; i < 3; ++i) {
    const int v = std::stoi(hex.substr(1 + 2 * i, 2), nullptr, 16);
    rgb[i] = static_cast<int>(std::lround(v + (255 - v) * amount));
  }
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x", rgb[0], rgb[1], rgb[2]);
  return buf;
}

}  // namespace treecp::viz
