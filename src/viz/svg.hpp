// viz/: pictures and traces of plans and runs (SVG, Chrome trace), from plans and measured spans.
//
// A small SVG writer: elements with attributes and escaped text, numbers in a short fixed form.
// The pictures (plan_svg.hpp, scaling_svg.hpp) are built with it; no plotting library is involved.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace treecp::viz {

std::string xml_escape(std::string_view text);
// Pixel coordinates: two decimals at most, trailing zeros dropped ("12.5", "3").
std::string px(double v);
// Values carried in data-* attributes for tools and tests: 9 significant digits.
std::string value(double v);

using Attrs = std::vector<std::pair<std::string, std::string>>;

class Svg {
 public:
  Svg(double width, double height);
  void open(const std::string& tag, const Attrs& attrs = {});  // <tag ...>
  void close();                                                // </tag> of the last open()
  // <tag .../>, or <tag ...>text</tag> when text is not empty; `tooltip` adds a <title> child.
  void element(const std::string& tag, const Attrs& attrs, std::string_view text = {},
               std::string_view tooltip = {});
  // Appends a <defs> block verbatim (patterns); the caller writes well-formed markup.
  void defs(std::string_view markup);
  std::string finish();  // closes the document; the writer is spent afterwards

 private:
  std::string out_;
  std::vector<std::string> open_;
};

// Colours: ranks get distinct hues (Tableau 10 without its grey, then golden-angle hues).
std::string rank_colour(int rank);
// `hex` mixed with white: 0 = unchanged, 1 = white.
std::string lighten(const std::string& hex, double amount);

}  // namespace treecp::viz
