// The topology's `kv_events` section: absent -> nothing published; present -> bound with vLLM's
// defaults; invalid -> an INVALID_ARGUMENT naming the key.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "config_cases.h"
#include "kvd/daemon/config.h"

namespace kvd::daemon {
namespace {

TEST(KvEventsConfigTest, AbsentIsOff) {
  auto c = ParseConfigYaml("node: n1\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->kv_events.has_value());
}

TEST(KvEventsConfigTest, BindsEveryKeyWithDefaults) {
  auto c = ParseConfigYaml(
      "kv_events: {endpoint: 'tcp://*:5557', replay_endpoint: 'tcp://*:5558', topic: kv,\n"
      "            buffer_steps: 50, max_batch_events: 8, hwm: 1000}\n");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->kv_events.has_value());
  EXPECT_EQ(c->kv_events->endpoint, "tcp://*:5557");
  EXPECT_EQ(c->kv_events->replay_endpoint, "tcp://*:5558");
  EXPECT_EQ(c->kv_events->topic, "kv");
  EXPECT_EQ(c->kv_events->buffer_steps, 50);
  EXPECT_EQ(c->kv_events->max_batch_events, 8);
  EXPECT_EQ(c->kv_events->hwm, 1000);

  auto d = ParseConfigYaml("kv_events: {endpoint: 'ipc:///tmp/kvd-events'}\n");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->kv_events->replay_endpoint, "");
  EXPECT_EQ(d->kv_events->topic, "");
  EXPECT_EQ(d->kv_events->buffer_steps, 10000);
  EXPECT_EQ(d->kv_events->hwm, 100000);
}

TEST(KvEventsConfigTest, InvalidValuesNameTheKey) {
  ExpectInvalidNamingKey({
      {"kv_events: {topic: t}\n", "kv_events.endpoint: required"},
      {"kv_events: {endpoint: '127.0.0.1:5557'}\n", "kv_events.endpoint"},
      {"kv_events: {endpoint: 'tcp://127.0.0.1'}\n", "kv_events.endpoint"},
      {"kv_events: {endpoint: 'tcp://h:1', replay_endpoint: 'udp://h:2'}\n",
       "kv_events.replay_endpoint"},
      {"kv_events: {endpoint: 'tcp://h:1', replay_endpoint: 'tcp://h:1'}\n",
       "kv_events.replay_endpoint: must differ"},
      {"kv_events: {endpoint: 'tcp://h:1', buffer_steps: 0}\n", "kv_events.buffer_steps"},
      {"kv_events: {endpoint: 'tcp://h:1', max_batch_events: 70000}\n",
       "kv_events.max_batch_events"},
      {"kv_events: {endpoint: 'tcp://h:1', hwm: x}\n", "kv_events.hwm"},
      {"kv_events: {endpoint: 'tcp://h:1', port: 3}\n", "kv_events.port: unknown key"},
      {"kv_events: [a]\n", "kv_events: must be a mapping"},
  });
}

}  // namespace
}  // namespace kvd::daemon
