// Fuzz target: arbitrary bytes as the files a user hands bertrain besides TFRecords: (1) a
// .safetensors checkpoint (header JSON, dtypes, shapes, offsets), (2) a config.json, (3) a
// vocab.txt (then tokenizing a fixed text with it), (4) a TensorFlow checkpoint's .index (its
// table blocks and BundleEntryProtos; the same bytes as its data file, every variable read).
// Invariants: nothing crashes, reads out of
// bounds or leaks (ASan/UBSan), and every rejection is a bertrain::Error (a clear message),
// never another exception escaping.
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/safetensors.h"
#include "data/tensor_bundle.h"
#include "model/config.h"
#include "prep/wordpiece.h"

using namespace bertrain;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  char path[] = "/tmp/bertrain_fuzz_files_XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return 0;
  if (write(fd, data, size) != static_cast<ssize_t>(size)) {
    close(fd);
    unlink(path);
    return 0;
  }
  close(fd);
  try {
    SafetensorsReader r(path);
    std::vector<float> buf;
    for (const auto& t : r.tensors()) {
      if (t.end - t.begin > (size_t{1} << 20)) continue;
      buf.resize((t.end - t.begin) / 2 + 1);
      r.read_f32(t, buf.data());
    }
  } catch (const Error&) {
  }
  try {
    model::BertConfig::load(path);
  } catch (const Error&) {
  }
  try {
    const prep::Vocab v = prep::Vocab::load(path);
    const prep::Tokenizer tok(v, true);
    std::vector<int32_t> ids;
    tok.encode("Hello, world! 你好 naïve [MASK] unaffable", ids);
  } catch (const Error&) {
  }
  const std::string index = std::string(path) + ".index";
  const std::string shard = std::string(path) + ".data-00000-of-00001";
  if (std::rename(path, index.c_str()) == 0) {
    if (FILE* f = std::fopen(shard.c_str(), "wb")) {
      std::fwrite(data, 1, size, f);
      std::fclose(f);
    }
    try {
      const data::TensorBundle b(path);
      for (const auto& v : b.variables()) {
        if (v.size > (int64_t{1} << 20)) continue;
        try {
          if (v.dtype == 3 || v.dtype == 9)
            b.read_i64(v);
          else
            b.read_f32(v);
        } catch (const Error&) {
        }
      }
    } catch (const Error&) {
    }
    unlink(index.c_str());
    unlink(shard.c_str());
  }
  unlink(path);
  return 0;
}
