// Fuzz target: arbitrary bytes as (1) a serialized tf.Example, (2) a BERT pretraining record,
// (3) a TFRecord file. Invariants: nothing crashes or leaks (ASan/UBSan); whatever protobuf
// accepts, the fast decoder accepts with the same contents; readers fail only with
// CorruptRecord or Error.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "data/example.h"
#include "data/schema.h"
#include "data/tfrecord.h"

using namespace bertrain;
using namespace bertrain::data;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  ExampleView view;
  const bool fast_ok = view.parse(bytes);
  bool pb_ok = true;
  Example ref;
  try {
    ref = decode_example(bytes);
  } catch (const Error&) {
    pb_ok = false;
  }
  if (pb_ok) {
    if (!fast_ok) {
      std::fprintf(stderr, "protobuf accepted what the fast decoder rejected: %s\n",
                   view.error().c_str());
      std::abort();
    }
    Example mine;
    try {
      mine = to_example(view);
    } catch (const Error&) {
      std::abort();  // protobuf parsed every list, so must we
    }
    if (!same_contents(mine, ref)) std::abort();
  }
  static const Schema schema = Schema::pretraining(8, 2, 1000);
  ParsedExample ex;
  std::string err;
  schema.parse(bytes, ex, err);

  char path[] = "/tmp/bertrain_fuzz_XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return 0;
  if (write(fd, data, size) != static_cast<ssize_t>(size)) {
    close(fd);
    unlink(path);
    return 0;
  }
  close(fd);
  for (Compression c : {Compression::None, Compression::Gzip}) {
    try {
      TFRecordReader r(path, c);
      std::string rec;
      for (int i = 0; i < 64; ++i) {
        try {
          if (!r.next(rec)) break;
        } catch (const CorruptRecord& e) {
          if (!e.resumable()) break;
        }
      }
    } catch (const Error&) {
    }
  }
  unlink(path);
  return 0;
}
