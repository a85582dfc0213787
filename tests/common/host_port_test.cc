#include "common/host_port.h"

#include <gtest/gtest.h>

namespace pdserve::common {
namespace {

TEST(HostPortTest, Ipv6LiteralsGetBrackets) {
  EXPECT_EQ(HostPort("::1", 8001), "[::1]:8001");
  EXPECT_EQ(HostPort("::", 9100), "[::]:9100");
  EXPECT_EQ(HostPort("fe80::1", 1), "[fe80::1]:1");
}

TEST(HostPortTest, Ipv4AndNamesStayAsTheyAre) {
  EXPECT_EQ(HostPort("127.0.0.1", 8000), "127.0.0.1:8000");
  EXPECT_EQ(HostPort("localhost", 0), "localhost:0");
  EXPECT_EQ(HostPort("decode-3.cluster.local", 9200), "decode-3.cluster.local:9200");
}

}  // namespace
}  // namespace pdserve::common
