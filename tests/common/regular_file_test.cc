#include "common/regular_file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <string>

namespace pdserve::common {
namespace {

class RegularFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/regular_file_test_" + std::to_string(getpid());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    std::ofstream(dir_ + "/file") << "x";
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

TEST_F(RegularFileTest, RegularFileIsOk) { EXPECT_TRUE(CheckRegularFile(dir_ + "/file").ok()); }

TEST_F(RegularFileTest, MissingFileSaysDoesNotExist) {
  const absl::Status s = CheckRegularFile(dir_ + "/none", "prompt file");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "prompt file " + dir_ + "/none does not exist");
  // A file standing where a directory of the path should be: ENOTDIR, also "does not exist".
  EXPECT_EQ(CheckRegularFile(dir_ + "/file/tokenizer.json").code(), absl::StatusCode::kNotFound);
}

TEST_F(RegularFileTest, SymlinkLoopSaysSo) {
  std::filesystem::create_symlink(dir_ + "/b", dir_ + "/a");
  std::filesystem::create_symlink(dir_ + "/a", dir_ + "/b");
  const absl::Status s = CheckRegularFile(dir_ + "/a");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), dir_ + "/a is a symlink loop (too many levels of symbolic links)");
}

TEST_F(RegularFileTest, DirectoryAndDeviceAreNotRegularFiles) {
  EXPECT_EQ(CheckRegularFile(dir_).message(), dir_ + " is not a regular file (a directory)");
  EXPECT_EQ(CheckRegularFile("/dev/zero").message(),
            "/dev/zero is not a regular file (a FIFO, socket or device)");
}

TEST(OpenErrorTest, PermissionIsNotNotFound) {
  const absl::Status denied = OpenError("/m/tokenizer.json", EACCES);
  EXPECT_EQ(denied.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(denied.message(), "cannot open /m/tokenizer.json: Permission denied");
  EXPECT_EQ(OpenError("/m/x", ENOENT).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(OpenError("/m/x", EIO).code(), absl::StatusCode::kUnknown);
}

TEST_F(RegularFileTest, WriteFileReplacesTheContent) {
  ASSERT_TRUE(WriteFile(dir_ + "/file", "{\"a\": 1}\n").ok());
  std::ifstream in(dir_ + "/file");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "{\"a\": 1}\n");
}

// A few bytes to a full disk: a buffered stream failed only at its unchecked close.
TEST(WriteFileTest, FullDiskIsAnError) {
  const absl::Status s = WriteFile("/dev/full", "{}\n", "--output");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnknown);
  EXPECT_EQ(s.message(), "cannot write --output /dev/full: No space left on device");
}

TEST_F(RegularFileTest, WriteFileIntoAMissingDirectoryIsNotFound) {
  const absl::Status s = WriteFile(dir_ + "/none/out.json", "x");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "cannot open " + dir_ + "/none/out.json: No such file or directory");
}

}  // namespace
}  // namespace pdserve::common
