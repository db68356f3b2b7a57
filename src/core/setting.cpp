#include "core/setting.h"

namespace bertrain {
namespace {
std::function<std::string(std::string_view)>& names() {
  static std::function<std::string(std::string_view)> f;
  return f;
}
}  // namespace

std::string setting(std::string_view field) {
  return names() ? names()(field) : std::string(field);
}

void set_setting_names(std::function<std::string(std::string_view)> name_of) {
  names() = std::move(name_of);
}

}  // namespace bertrain
