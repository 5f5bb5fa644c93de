#include "json_reader.h"

#include <cerrno>
#include <cstdlib>

namespace dsv4_example {

class JsonParser {
 public:
  explicit JsonParser(const std::string& text) : s_(text) {}

  Json Document() {
    Json v = Value(0);
    SkipSpace();
    if (pos_ != s_.size()) Fail("trailing characters after the JSON value");
    return v;
  }

 private:
  static constexpr int kMaxDepth = 64;  // dsv4_ort.json nests 4 deep; this bounds recursion on hostile input

  [[noreturn]] void Fail(const std::string& why) const {
    throw std::runtime_error("JSON error at byte " + std::to_string(pos_) + ": " + why);
  }

  void SkipSpace() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }

  bool Consume(const char* word) {
    size_t n = std::char_traits<char>::length(word);
    if (s_.compare(pos_, n, word) != 0) return false;
    pos_ += n;
    return true;
  }

  Json Value(int depth) {
    if (depth > kMaxDepth) Fail("nesting deeper than " + std::to_string(kMaxDepth));
    SkipSpace();
    if (pos_ >= s_.size()) Fail("unexpected end of input");
    Json v;
    char c = s_[pos_];
    if (c == '{') {
      v.kind_ = Json::Kind::Object;
      ++pos_;
      SkipSpace();
      if (pos_ < s_.size() && s_[pos_] == '}') { ++pos_; return v; }
      for (;;) {
        SkipSpace();
        if (pos_ >= s_.size() || s_[pos_] != '"') Fail("expected a string key");
        std::string key = String();
        SkipSpace();
        if (pos_ >= s_.size() || s_[pos_] != ':') Fail("expected ':'");
        ++pos_;
        Json member = Value(depth + 1);
        if (!v.object_.emplace(std::move(key), std::move(member)).second) Fail("duplicate key");
        SkipSpace();
        if (pos_ < s_.size() && s_[pos_] == ',') { ++pos_; continue; }
        if (pos_ < s_.size() && s_[pos_] == '}') { ++pos_; return v; }
        Fail("expected ',' or '}'");
      }
    }
    if (c == '[') {
      v.kind_ = Json::Kind::Array;
      ++pos_;
      SkipSpace();
      if (pos_ < s_.size() && s_[pos_] == ']') { ++pos_; return v; }
      for (;;) {
        v.array_.push_back(Value(depth + 1));
        SkipSpace();
        if (pos_ < s_.size() && s_[pos_] == ',') { ++pos_; continue; }
        if (pos_ < s_.size() && s_[pos_] == ']') { ++pos_; return v; }
        Fail("expected ',' or ']'");
      }
    }
    if (c == '"') {
      v.kind_ = Json::Kind::String;
      v.string_ = String();
      return v;
    }
    if (Consume("true")) { v.kind_ = Json::Kind::Bool; v.bool_ = true; return v; }
    if (Consume("false")) { v.kind_ = Json::Kind::Bool; return v; }
    if (Consume("null")) return v;
    if (c == '-' || (c >= '0' && c <= '9')) return Number();
    Fail(std::string("unexpected character '") + c + "'");
  }

  Json Number() {
    size_t start = pos_;
    bool integral = true;
    if (s_[pos_] == '-') ++pos_;
    if (pos_ >= s_.size() || !(s_[pos_] >= '0' && s_[pos_] <= '9')) Fail("malformed number");
    if (s_[pos_] == '0') {
      ++pos_;  // no leading zeros
    } else {
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    }
    if (pos_ < s_.size() && s_[pos_] == '.') {
      integral = false;
      ++pos_;
      if (pos_ >= s_.size() || !(s_[pos_] >= '0' && s_[pos_] <= '9')) Fail("malformed fraction");
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      integral = false;
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (pos_ >= s_.size() || !(s_[pos_] >= '0' && s_[pos_] <= '9')) Fail("malformed exponent");
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    }
    std::string text = s_.substr(start, pos_ - start);
    Json v;
    v.kind_ = Json::Kind::Number;
    v.number_ = std::strtod(text.c_str(), nullptr);  // the grammar was checked above; strtod only converts
    if (integral) {
      errno = 0;
      long long i = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == 0) { v.is_int_ = true; v.int_ = static_cast<int64_t>(i); }  // out of range: a double only
    }
    return v;
  }

  unsigned Hex4() {
    if (pos_ + 4 > s_.size()) Fail("truncated \\u escape");
    unsigned cp = 0;
    for (int i = 0; i < 4; ++i) {
      char h = s_[pos_++];
      cp <<= 4;
      if (h >= '0' && h <= '9') cp |= unsigned(h - '0');
      else if (h >= 'a' && h <= 'f') cp |= unsigned(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F') cp |= unsigned(h - 'A' + 10);
      else Fail("bad hex digit in \\u escape");
    }
    return cp;
  }

  static void AppendUtf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xC0 | (cp >> 6));
      out += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += char(0xE0 | (cp >> 12));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    } else {
      out += char(0xF0 | (cp >> 18));
      out += char(0x80 | ((cp >> 12) & 0x3F));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    }
  }

  std::string String() {
    ++pos_;  // the opening quote
    std::string out;
    for (;;) {
      if (pos_ >= s_.size()) Fail("unterminated string");
      unsigned char c = static_cast<unsigned char>(s_[pos_++]);
      if (c == '"') return out;
      if (c < 0x20) Fail("control character in string");
      if (c != '\\') { out += char(c); continue; }  // UTF-8 bytes pass through unchanged
      if (pos_ >= s_.size()) Fail("unterminated escape");
      char e = s_[pos_++];
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
          unsigned cp = Hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // a high surrogate must be followed by a low one
            if (!Consume("\\u")) Fail("lone high surrogate");
            unsigned lo = Hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) Fail("bad low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            Fail("lone low surrogate");
          }
          AppendUtf8(out, cp);
          break;
        }
        default: Fail("unknown escape");
      }
    }
  }

  const std::string& s_;
  size_t pos_ = 0;
};

Json Json::Parse(const std::string& text) { return JsonParser(text).Document(); }

const std::string& Json::str(const char* what) const {
  if (kind_ != Kind::String) throw std::runtime_error(std::string(what) + " must be a string");
  return string_;
}

int64_t Json::integer(const char* what) const {
  if (!is_integer()) throw std::runtime_error(std::string(what) + " must be an integer");
  return int_;
}

const std::vector<Json>& Json::array(const char* what) const {
  if (kind_ != Kind::Array) throw std::runtime_error(std::string(what) + " must be an array");
  return array_;
}

const Json* Json::find(const std::string& key) const {
  if (kind_ != Kind::Object) return nullptr;
  auto it = object_.find(key);
  return it == object_.end() ? nullptr : &it->second;
}

const Json& Json::at(const std::string& key) const {
  if (kind_ != Kind::Object) throw std::runtime_error("expected an object holding '" + key + "'");
  const Json* v = find(key);
  if (v == nullptr) throw std::runtime_error("'" + key + "' is missing");
  return *v;
}

}  // namespace dsv4_example
