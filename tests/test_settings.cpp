// Library messages name settings by field (core/setting.h); a front end shows them its own way.
// This test binary is a front end like the CLI: it installs the CLI's rule (--seq-len for
// seq_len; tests/cli/settings_are_flags.sh proves each named field is a real flag), so the tests
// that check user-facing messages read them as users see them. Without a front end the message
// names the field itself.
#include <gtest/gtest.h>

#include <algorithm>

#include "core/error.h"
#include "core/setting.h"
#include "test_util.h"

namespace bertrain {
namespace {

std::string as_flag(std::string_view field) {
  std::string f(field);
  std::replace(f.begin(), f.end(), '_', '-');
  return "--" + f;
}

const bool g_installed = [] {
  set_setting_names(as_flag);
  return true;
}();

TEST(Settings, MessagesNameFieldsAndTheFrontEndShowsItsOwnNames) {
  ASSERT_TRUE(g_installed);
  EXPECT_EQ(str("lower ", setting("batch_size")), "lower --batch-size");
  set_setting_names(nullptr);  // a library user with no front end: the field names
  EXPECT_EQ(str("lower ", setting("batch_size")), "lower batch_size");
  EXPECT_EQ(test::error_of([] { fail(setting("seq_len"), " must be positive"); }),
            "seq_len must be positive");
  set_setting_names([](std::string_view f) { return "job.spec." + std::string(f); });
  EXPECT_EQ(setting("lr"), "job.spec.lr");
  set_setting_names(as_flag);
}

}  // namespace
}  // namespace bertrain
