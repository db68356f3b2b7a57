#include <gtest/gtest.h>
#include "core/dtype.h"
TEST(DType, Placeholder) { EXPECT_EQ(bertrain::dtype_size(bertrain::DType::BF16), 2u); }
