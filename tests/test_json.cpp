// The JSON reader and writer: values, escapes, 64-bit integers, and malformed documents with positions.
#include <gtest/gtest.h>

#include <string>

#include "core/error.hpp"
#include "core/json.hpp"

namespace treecp {
namespace {

std::string error_of(const std::string& text) {
  try {
    json::parse(text);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Json, ParsesValuesAndRoundTrips) {
  const json::Value v = json::parse(
      R"({"a": [1, -2, 9223372036854775807, -9223372036854775808], "b": {"c": true, "d": null},
          "e": "q\"\\\/\n\t\u00e9\ud83d\ude00", "f": -1.5e-3, "g": []})");
  EXPECT_EQ(v.at("a")[2].as_int(), INT64_MAX);
  EXPECT_EQ(v.at("a")[3].as_int(), INT64_MIN);
  EXPECT_TRUE(v.at("b").at("c").as_bool());
  EXPECT_TRUE(v.at("b").at("d").is_null());
  EXPECT_EQ(v.at("e").as_string(), "q\"\\/\n\t\xC3\xA9\xF0\x9F\x98\x80");
  EXPECT_DOUBLE_EQ(v.at("f").as_double(), -1.5e-3);
  EXPECT_EQ(v.at("g").size(), 0u);
  for (int indent : {-1, 2}) {
    const json::Value again = json::parse(json::dump(v, indent));
    EXPECT_EQ(json::dump(again), json::dump(v));
  }
}

TEST(Json, MalformedDocumentsNameTheirPosition) {
  EXPECT_EQ(error_of("{\"a\": 1,\n  }"), "malformed JSON at line 2, column 3: expected a string key");
  EXPECT_NE(error_of("[1, 2").find("expected ',' or ']'"), std::string::npos);
  EXPECT_NE(error_of("{\"a\": 1, \"a\": 2}").find("duplicate key \"a\""), std::string::npos);
  EXPECT_NE(error_of("\"abc").find("unterminated string"), std::string::npos);
  EXPECT_NE(error_of("01").find("trailing"), std::string::npos);
  EXPECT_NE(error_of("99999999999999999999").find("out of 64-bit range"), std::string::npos);
  EXPECT_NE(error_of("[1] x").find("trailing"), std::string::npos);
  EXPECT_NE(error_of("tru").find("unknown literal"), std::string::npos);
  EXPECT_NE(error_of(std::string(300, '[')).find("nesting deeper than 256"), std::string::npos);
  // type errors name what was asked for
  try {
    json::parse("{\"n\": \"x\"}").at("n").as_int("costs.n");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "costs.n: expected an integer, got a string");
  }
}

}  // namespace
}  // namespace treecp
