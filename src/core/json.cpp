#include "core/json.hpp"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <unordered_set>

#include "core/error.hpp"

namespace treecp::json {

const char* Value::type_name(Type t) {
  switch (t) {
    case Type::Null: return "null";
    case Type::Bool: return "a boolean";
    case Type::Int: return "an integer";
    case Type::Double: return "a number";
    case Type::String: return "a string";
    case Type::Array: return "an array";
    case Type::Object: return "an object";
  }
  return "?";
}

bool Value::as_bool(std::string_view what) const {
  require(type_ == Type::Bool, what, ": expected a boolean, got ", type_name(type_));
  return bool_;
}
int64_t Value::as_int(std::string_view what) const {
  require(type_ == Type::Int, what, ": expected an integer, got ", type_name(type_));
  return int_;
}
double Value::as_double(std::string_view what) const {
  require(is_number(), what, ": expected a number, got ", type_name(type_));
  return type_ == Type::Int ? static_cast<double>(int_) : double_;
}
const std::string& Value::as_string(std::string_view what) const {
  require(type_ == Type::String, what, ": expected a string, got ", type_name(type_));
  return string_;
}
const std::vector<Value>& Value::as_array(std::string_view what) const {
  require(type_ == Type::Array, what, ": expected an array, got ", type_name(type_));
  return array_;
}
const std::vector<std::pair<std::string, Value>>& Value::as_object(std::string_view what) const {
  require(type_ == Type::Object, what, ": expected an object, got ", type_name(type_));
  return object_;
}

Value& Value::push_back(Value v) {
  require(type_ == Type::Array, "json: push_back on ", type_name(type_));
  array_.push_back(std::move(v));
  return array_.back();
}
size_t Value::size() const { return type_ == Type::Array ? array_.size() : object_.size(); }
const Value& Value::operator[](size_t i) const {
  require(type_ == Type::Array && i < array_.size(), "json: index ", i, " out of range");
  return array_[i];
}
Value& Value::set(const std::string& key, Value v) {
  require(type_ == Type::Object, "json: set on ", type_name(type_));
  for (auto& [k, existing] : object_) {
    if (k == key) { existing = std::move(v); return existing; }
  }
  object_.emplace_back(key, std::move(v));
  return object_.back().second;
}
const Value* Value::find(std::string_view key) const {
  if (type_ != Type::Object) return nullptr;
  for (const auto& [k, v] : object_) {
    if (k == key) return &v;
  }
  return nullptr;
}
const Value& Value::at(std::string_view key, std::string_view what) const {
  const Value* v = find(key);
  require(v != nullptr, what, ": missing key \"", key, "\"");
  return *v;
}

namespace {

class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}
  Parser(std::string_view text, std::string_view stream_key,
         const std::function<void(size_t, const Value&)>* stream_element)
      : text_(text), stream_key_(stream_key), stream_element_(stream_element) {}

  Value document() {
    skip_space();
    Value v = value(0);
    skip_space();
    if (pos_ != text_.size()) error("unexpected trailing characters");
    return v;
  }

 private:
  static constexpr int kMaxDepth = 256;
  static constexpr size_t kLinearKeys = 16;  // objects up to this many keys look for duplicates by scanning

  [[noreturn]] void error(const std::string& what) const {
    size_t line = 1, col = 1;
    for (size_t i = 0; i < pos_ && i < text_.size(); ++i) {
      if (text_[i] == '\n') { ++line; col = 1; } else { ++col; }
    }
    fail("malformed JSON at line ", line, ", column ", col, ": ", what);
  }
  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return at_end() ? '\0' : text_[pos_]; }
  void skip_space() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r')) ++pos_;
  }
  void expect(char c) {
    if (peek() != c) error(std::string("expected '") + c + "'");
    ++pos_;
  }
  void literal(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) error("unknown literal");
    pos_ += word.size();
  }

  Value value(int depth) {
    if (depth > kMaxDepth) error("nesting deeper than 256");
    if (at_end()) error("unexpected end of input");
    switch (peek()) {
      case '{': return object(depth);
      case '[': return array(depth);
      case '"': return Value(string());
      case 't': literal("true"); return Value(true);
      case 'f': literal("false"); return Value(false);
      case 'n': literal("null"); return Value();
      default: return number();
    }
  }

  Value object(int depth) {
    expect('{');
    std::vector<std::pair<std::string, Value>> members;
    std::unordered_set<std::string> seen;  // keys of a large object: duplicates found in O(1), not O(members)
    skip_space();
    if (peek() == '}') { ++pos_; return Value::object(std::move(members)); }
    for (;;) {
      skip_space();
      if (peek() != '"') error("expected a string key");
      std::string key = string();
      bool duplicate = false;
      if (members.size() < kLinearKeys) {
        for (const auto& m : members) duplicate = duplicate || m.first == key;
      } else {
        if (seen.empty()) {
          for (const auto& m : members) seen.insert(m.first);
        }
        duplicate = !seen.insert(key).second;
      }
      if (duplicate) error("duplicate key \"" + printable(key) + "\"");
      skip_space();
      expect(':');
      skip_space();
      if (stream_element_ != nullptr && depth == 0 && key == stream_key_ && peek() == '[') {
        members.emplace_back(std::move(key), array(depth + 1, stream_element_));
      } else {
        members.emplace_back(std::move(key), value(depth + 1));
      }
      skip_space();
      if (peek() == ',') { ++pos_; continue; }
      if (peek() == '}') { ++pos_; return Value::object(std::move(members)); }
      error("expected ',' or '}'");
    }
  }

  // With `element`, each element goes to it as soon as it is parsed and the array stays empty.
  Value array(int depth, const std::function<void(size_t, const Value&)>* element = nullptr) {
    expect('[');
    Value arr = Value::array();
    skip_space();
    if (peek() == ']') { ++pos_; return arr; }
    for (size_t index = 0;; ++index) {
      skip_space();
      if (element != nullptr) {
        (*element)(index, value(depth + 1));
      } else {
        arr.push_back(value(depth + 1));
      }
      skip_space();
      if (peek() == ',') { ++pos_; continue; }
      if (peek() == ']') { ++pos_; return arr; }
      error("expected ',' or ']'");
    }
  }

  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  uint32_t hex4() {
    if (pos_ + 4 > text_.size()) error("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      char c = text_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= static_cast<uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f') v |= static_cast<uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= static_cast<uint32_t>(c - 'A' + 10);
      else error("bad hex digit in \\u escape");
    }
    return v;
  }

  std::string string() {
    expect('"');
    std::string out;
    for (;;) {
      if (at_end()) error("unterminated string");
      char c = text_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) error("control character in string");
      if (c != '\\') { out += c; continue; }
      if (at_end()) error("unterminated escape");
      char e = text_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00 && text_.substr(pos_, 2) == "\\u") {
            pos_ += 2;
            uint32_t lo = hex4();
            if (lo < 0xDC00 || lo >= 0xE000) error("bad surrogate pair");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default: error("unknown escape");
      }
    }
  }

  Value number() {
    size_t start = pos_;
    bool is_float = false;
    if (peek() == '-') ++pos_;
    if (!(peek() >= '0' && peek() <= '9')) error("unexpected character");
    if (peek() == '0') {
      ++pos_;
    } else {
      while (peek() >= '0' && peek() <= '9') ++pos_;
    }
    if (peek() == '.') {
      is_float = true;
      ++pos_;
      if (!(peek() >= '0' && peek() <= '9')) error("expected digits after '.'");
      while (peek() >= '0' && peek() <= '9') ++pos_;
    }
    if (peek() == 'e' || peek() == 'E') {
      is_float = true;
      ++pos_;
      if (peek() == '+' || peek() == '-') ++pos_;
      if (!(peek() >= '0' && peek() <= '9')) error("expected digits in exponent");
      while (peek() >= '0' && peek() <= '9') ++pos_;
    }
    std::string token(text_.substr(start, pos_ - start));
    errno = 0;
    if (!is_float) {
      long long v = std::strtoll(token.c_str(), nullptr, 10);
      if (errno == ERANGE) { pos_ = start; error("integer out of 64-bit range"); }
      return Value(static_cast<int64_t>(v));
    }
    double d = std::strtod(token.c_str(), nullptr);
    return Value(d);
  }

  std::string_view text_;
  size_t pos_ = 0;
  std::string_view stream_key_;
  const std::function<void(size_t, const Value&)>* stream_element_ = nullptr;
};

void write_string(std::string& out, const std::string& s) {
  out += '"';
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

void write(std::string& out, const Value& v, int indent, int level) {
  auto newline = [&](int lvl) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent * lvl), ' ');
  };
  switch (v.type()) {
    case Value::Type::Null: out += "null"; break;
    case Value::Type::Bool: out += v.as_bool() ? "true" : "false"; break;
    case Value::Type::Int: out += std::to_string(v.as_int()); break;
    case Value::Type::Double: {
      double d = v.as_double();
      if (!std::isfinite(d)) { out += "null"; break; }
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.17g", d);
      out += buf;
      break;
    }
    case Value::Type::String: write_string(out, v.as_string()); break;
    case Value::Type::Array: {
      const auto& a = v.as_array();
      out += '[';
      // Arrays of scalars stay on one line: plans hold many short ranges.
      bool flat = true;
      for (const auto& e : a) flat = flat && !e.is_array() && !e.is_object();
      for (size_t i = 0; i < a.size(); ++i) {
        if (i) out += indent >= 0 && flat ? ", " : ",";
        if (!flat) newline(level + 1);
        write(out, a[i], indent, level + 1);
      }
      if (!flat && !a.empty()) newline(level);
      out += ']';
      break;
    }
    case Value::Type::Object: {
      const auto& o = v.as_object();
      out += '{';
      for (size_t i = 0; i < o.size(); ++i) {
        if (i) out += ',';
        newline(level + 1);
        write_string(out, o[i].first);
        out += indent >= 0 ? ": " : ":";
        write(out, o[i].second, indent, level + 1);
      }
      if (!o.empty()) newline(level);
      out += '}';
      break;
    }
  }
}

}  // namespace

Value parse(std::string_view text) { return Parser(text).document(); }

Value parse_streaming(std::string_view text, std::string_view key,
                      const std::function<void(size_t, const Value&)>& element) {
  return Parser(text, key, &element).document();
}

std::string dump(const Value& value, int indent) {
  std::string out;
  write(out, value, indent, 0);
  return out;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  require(in.good(), "cannot read file '", path, "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  require(!in.bad(), "error while reading file '", path, "'");
  return ss.str();
}

}  // namespace treecp::json
