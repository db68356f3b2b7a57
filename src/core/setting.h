// Settings named in messages. Library code knows a setting by its field name ("seq_len", "lr",
// "on_corrupt") and names it with setting("seq_len"); how a user sets it is the front end's
// business: the CLI installs its flags ("--seq-len", cli/main.cpp), a job spec would install
// its keys. With no front end installed (a library user, a unit test) the field name is shown.
#pragma once

#include <functional>
#include <string>
#include <string_view>

namespace bertrain {

std::string setting(std::string_view field);

// name_of(field) -> what the user writes; installed once, before any message is made.
void set_setting_names(std::function<std::string(std::string_view)> name_of);

}  // namespace bertrain
