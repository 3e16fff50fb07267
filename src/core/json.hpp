// core/: the ground every layer stands on: errors, JSON, .npy and output files, trace spans, random values.
//
// A small JSON value with a strict parser and a writer. Parse errors name line and column.
// Integers keep full int64 precision (token counts reach 2^31 and pair counts 2^62).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace treecp::json {

class Value {
 public:
  enum class Type { Null, Bool, Int, Double, String, Array, Object };

  Value() = default;
  Value(std::nullptr_t) {}
  Value(bool b) : type_(Type::Bool), bool_(b) {}
  Value(int v) : type_(Type::Int), int_(v) {}
  Value(int64_t v) : type_(Type::Int), int_(v) {}
  Value(uint64_t v) : type_(Type::Int), int_(static_cast<int64_t>(v)) {}
  Value(double v) : type_(Type::Double), double_(v) {}
  Value(const char* s) : type_(Type::String), string_(s) {}
  Value(std::string s) : type_(Type::String), string_(std::move(s)) {}

  static Value array() { Value v; v.type_ = Type::Array; return v; }
  static Value object() { Value v; v.type_ = Type::Object; return v; }
  // An object of these members, in this order; their keys must be distinct (set() is not called).
  static Value object(std::vector<std::pair<std::string, Value>> members) {
    Value v = object();
    v.object_ = std::move(members);
    return v;
  }

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::Null; }
  bool is_bool() const { return type_ == Type::Bool; }
  bool is_int() const { return type_ == Type::Int; }
  bool is_number() const { return type_ == Type::Int || type_ == Type::Double; }
  bool is_string() const { return type_ == Type::String; }
  bool is_array() const { return type_ == Type::Array; }
  bool is_object() const { return type_ == Type::Object; }

  // Accessors throw treecp::Error naming `what` when the type does not match.
  bool as_bool(std::string_view what = "value") const;
  int64_t as_int(std::string_view what = "value") const;
  double as_double(std::string_view what = "value") const;
  const std::string& as_string(std::string_view what = "value") const;
  const std::vector<Value>& as_array(std::string_view what = "value") const;
  const std::vector<std::pair<std::string, Value>>& as_object(std::string_view what = "value") const;

  // Arrays.
  Value& push_back(Value v);
  size_t size() const;
  const Value& operator[](size_t i) const;

  // Objects keep insertion order; set() replaces an existing key.
  Value& set(const std::string& key, Value v);
  const Value* find(std::string_view key) const;
  bool contains(std::string_view key) const { return find(key) != nullptr; }
  // The member `key`; throws naming `what` and the key when it is missing.
  const Value& at(std::string_view key, std::string_view what = "object") const;

  static const char* type_name(Type t);

 private:
  Type type_ = Type::Null;
  bool bool_ = false;
  int64_t int_ = 0;
  double double_ = 0.0;
  std::string string_;
  std::vector<Value> array_;
  std::vector<std::pair<std::string, Value>> object_;
};

// Parses a whole document; throws treecp::Error("malformed JSON at line L, column C: ...").
Value parse(std::string_view text);

// Parses like parse(), but hands each element of the array under the top-level key `key` to
// `element` as soon as it is parsed, instead of keeping it (that array stays empty in the result):
// a row of a million segments costs the caller's own records, not a million JSON values.
Value parse_streaming(std::string_view text, std::string_view key,
                      const std::function<void(size_t index, const Value& value)>& element);

// Writes compact JSON (indent < 0) or indented JSON.
std::string dump(const Value& value, int indent = -1);

// Reads a file into a string; throws treecp::Error naming the path when it cannot be read.
std::string read_file(const std::string& path);

}  // namespace treecp::json
