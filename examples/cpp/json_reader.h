// A small, strict JSON reader (RFC 8259) for dsv4_ort.json: enough to read what the example needs, robust against
// malformed input (every error is a std::runtime_error naming the byte offset; nesting depth is bounded, so a
// hostile file cannot overflow the stack). Numbers are kept as double plus, when the text is an integer that fits,
// as int64 (shapes and counts need exact integers). Not a general-purpose library: no writer, no streaming.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace dsv4_example {

class Json {
 public:
  enum class Kind { Null, Bool, Number, String, Array, Object };

  static Json Parse(const std::string& text);

  Kind kind() const { return kind_; }
  bool is_string() const { return kind_ == Kind::String; }
  bool is_array() const { return kind_ == Kind::Array; }
  bool is_object() const { return kind_ == Kind::Object; }
  bool is_integer() const { return kind_ == Kind::Number && is_int_; }

  // Typed access; each throws std::runtime_error naming `what` when the value has another type.
  const std::string& str(const char* what) const;
  int64_t integer(const char* what) const;
  const std::vector<Json>& array(const char* what) const;
  // Member of an object; throws when absent (or when this is not an object).
  const Json& at(const std::string& key) const;
  // Member of an object, or nullptr when absent.
  const Json* find(const std::string& key) const;

 private:
  friend class JsonParser;
  Kind kind_ = Kind::Null;
  bool bool_ = false;
  bool is_int_ = false;
  double number_ = 0.0;
  int64_t int_ = 0;
  std::string string_;
  std::vector<Json> array_;
  std::map<std::string, Json> object_;  // a duplicate key is an error, not "last one wins"
};

}  // namespace dsv4_example
