#include "staleness_bench.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <span>
#include <thread>
#include <vector>

#include "kv_events_watch.h"

namespace kvd::tools::cluster_bench {
namespace {

using client::Client;
using client::LookupOptions;
using client::LookupResult;

double Us(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

// p50 / p99 / max (and min) of `us`, nearest rank.
nlohmann::json Summary(std::vector<double> us) {
  nlohmann::json o = {{"samples", us.size()}};
  if (us.empty()) return o;
  std::sort(us.begin(), us.end());
  auto at = [&](double p) { return us[static_cast<size_t>(p * (us.size() - 1) + 0.5)]; };
  o["min_us"] = us.front();
  o["p50_us"] = at(0.50);
  o["p99_us"] = at(0.99);
  o["max_us"] = us.back();
  return o;
}

// The chunks `holder` holds of a one-chunk chain by `found`, or nullopt when it gave no answer
// (not listed, or listed with an error).
std::optional<uint32_t> HeldBy(const LookupResult& found, const std::string& holder) {
  for (const auto& h : found.holders) {
    if (h.node == holder) return h.error.empty() ? std::optional(h.matched_chunks) : std::nullopt;
  }
  return std::nullopt;
}

// What one poll loop saw: when the condition first held (the end of that lookup) and how many
// cluster lookups it took (1: the first lookup after the change already saw it).
struct Seen {
  Clock::time_point at;
  int64_t lookups = 0;
};

// Cluster lookups of `chain` at `reader`, one after another, until `done` holds for one (true)
// or `deadline` passes. Releases each lookup's lease.
StatusOr<Seen> PollUntil(Client& reader, std::span<const Hash128> chain,
                         const std::function<bool(const LookupResult&)>& done,
                         Clock::time_point deadline) {
  Seen seen;
  while (true) {
    KVD_ASSIGN_OR_RETURN(LookupResult found, reader.Lookup(chain, LookupOptions{.cluster = true}));
    seen.at = Clock::now();
    ++seen.lookups;
    if (found.lease_id != 0) KVD_RETURN_IF_ERROR(reader.ReleaseLease(found.lease_id));
    if (done(found)) return seen;
    if (seen.at >= deadline) return Status(StatusCode::kDeadlineExceeded, "change never showed");
  }
}

Hash128 RandomHash(std::mt19937_64& rng) { return Hash128{rng(), rng()}; }

// How long one kind of change (a put committed, a chunk evicted) took to show, one entry per
// sample: at the reader's cluster lookups and at the events subscriber.
struct ChangeFigures {
  std::vector<double> to_lookup, to_event;
  int64_t max_lookups = 0;
};

// The figures of a run, one entry per sample.
struct Tally {
  ChangeFigures commit, evict;
  std::vector<double> put_us, evict_us;
};

class StalenessRun {
 public:
  explicit StalenessRun(const StalenessOptions& o) : o_(o), rng_(std::random_device{}()) {}

  // Connects the reader, the writer, the writer's admin client and the events subscriber.
  Status Connect();
  // One sample: put, seen, unpinned, evicted, seen gone.
  Status Sample();
  nlohmann::json Report() const;

 private:
  // Evicts `hash` at the writer. A chunk a peer lookup leased stays pinned until the reader's
  // kvd sends that peer its next request, so a pinned chunk gets a cluster lookup of a chain
  // nobody holds (which carries the release) and another try.
  Status Evict(const Hash128& hash);
  // Times how long the change to `hash` made at `t0` takes to show: cluster lookups until `done`
  // holds, then (with a subscriber) its BlockStored (`stored`) or BlockRemoved event.
  Status TimeChange(const Hash128& hash, Clock::time_point t0, bool stored,
                    const std::function<bool(const LookupResult&)>& done, ChangeFigures* f);

  const StalenessOptions& o_;
  std::mt19937_64 rng_;
  std::unique_ptr<Client> reader_, writer_, admin_;
  std::unique_ptr<KvEventsWatch> events_;
  std::vector<uint8_t> bytes_;
  Tally t_;
};

Status StalenessRun::Connect() {
  KVD_ASSIGN_OR_RETURN(reader_, Client::Connect(o_.reader));
  if (!reader_->session().cluster_lookup) {
    return Status(StatusCode::kFailedPrecondition, "the reader's kvd is in no cluster");
  }
  KVD_ASSIGN_OR_RETURN(writer_, Client::Connect(o_.writer));
  client::ClientOptions admin = o_.writer;
  admin.role = client::Role::kAdmin;
  admin.model.clear();
  KVD_ASSIGN_OR_RETURN(admin_, Client::Connect(admin));
  if (!o_.events.empty()) {
    KVD_ASSIGN_OR_RETURN(events_, KvEventsWatch::Start(o_.events));
  }
  bytes_.assign(client::RawChunkBytes(o_.writer.layout, o_.tokens), 0x5a);
  // The reader's kvd connects to each peer on the first cluster lookup that asks it: done here,
  // so that the samples time lookups over standing connections.
  const Hash128 nobody = RandomHash(rng_);
  KVD_RETURN_IF_ERROR(
      reader_->Lookup(std::span(&nobody, 1), LookupOptions{.cluster = true}).status());
  // The subscription is live once a chunk put now shows as an event (ZeroMQ drops what a PUB
  // socket sends before a subscriber's connection completes).
  if (events_) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(o_.wait_ms);
    while (Clock::now() < deadline) {
      const Hash128 warm = RandomHash(rng_);
      KVD_RETURN_IF_ERROR(writer_->Put(warm, o_.tokens, bytes_.data(), bytes_.size()).status());
      if (events_->WaitFor(warm.lo, true, Clock::now() + std::chrono::milliseconds(200))) {
        return Status::Ok();
      }
    }
    return Status(StatusCode::kDeadlineExceeded, "no KV event arrived from " + o_.events);
  }
  return Status::Ok();
}

Status StalenessRun::Evict(const Hash128& hash) {
  const Hash128 nobody = RandomHash(rng_);
  for (int attempt = 0; attempt < 100; ++attempt) {
    KVD_ASSIGN_OR_RETURN(LookupResult miss,
                         reader_->Lookup(std::span(&nobody, 1), LookupOptions{.cluster = true}));
    (void)miss;
    const auto t0 = Clock::now();
    client::EvictFilter one;
    one.kind = client::EvictFilter::Kind::kChunk;
    one.chunk = hash;
    KVD_ASSIGN_OR_RETURN(client::EvictResult r, admin_->Evict(one));
    if (r.chunks == 1) {
      t_.evict_us.push_back(Us(Clock::now() - t0));
      return Status::Ok();
    }
    if (r.skipped_pinned == 0) return Status(StatusCode::kInternal, "evict found no chunk");
  }
  return Status(StatusCode::kDeadlineExceeded, "chunk stayed pinned");
}

Status StalenessRun::TimeChange(const Hash128& hash, Clock::time_point t0, bool stored,
                                const std::function<bool(const LookupResult&)>& done,
                                ChangeFigures* f) {
  const Clock::time_point deadline = t0 + std::chrono::milliseconds(o_.wait_ms);
  KVD_ASSIGN_OR_RETURN(Seen seen, PollUntil(*reader_, std::span(&hash, 1), done, deadline));
  f->to_lookup.push_back(Us(seen.at - t0));
  f->max_lookups = std::max(f->max_lookups, seen.lookups);
  if (!events_) return Status::Ok();
  auto at = events_->WaitFor(hash.lo, stored, deadline);
  if (!at) {
    return Status(StatusCode::kDeadlineExceeded,
                  stored ? "BlockStored never arrived" : "BlockRemoved never arrived");
  }
  f->to_event.push_back(Us(*at - t0));
  return Status::Ok();
}

Status StalenessRun::Sample() {
  const Hash128 hash = RandomHash(rng_);
  const auto t_put = Clock::now();
  KVD_RETURN_IF_ERROR(writer_->Put(hash, o_.tokens, bytes_.data(), bytes_.size()).status());
  const auto t_commit = Clock::now();
  t_.put_us.push_back(Us(t_commit - t_put));
  auto held = [&](const LookupResult& r) { return HeldBy(r, o_.holder).value_or(0) >= 1; };
  KVD_RETURN_IF_ERROR(TimeChange(hash, t_commit, true, held, &t_.commit));
  KVD_RETURN_IF_ERROR(Evict(hash));
  auto gone = [&](const LookupResult& r) { return HeldBy(r, o_.holder) == 0u; };
  return TimeChange(hash, Clock::now(), false, gone, &t_.evict);
}

nlohmann::json StalenessRun::Report() const {
  nlohmann::json j = {{"ok", true},
                      {"op", "staleness"},
                      {"holder", o_.holder},
                      {"tokens", o_.tokens},
                      {"chunk_bytes", bytes_.size()},
                      {"put", Summary(t_.put_us)},
                      {"evict", Summary(t_.evict_us)},
                      {"commit_to_visible", Summary(t_.commit.to_lookup)},
                      {"evict_to_invisible", Summary(t_.evict.to_lookup)},
                      {"max_lookups_to_visible", t_.commit.max_lookups},
                      {"max_lookups_to_invisible", t_.evict.max_lookups}};
  if (events_) {
    j["commit_to_event"] = Summary(t_.commit.to_event);
    j["evict_to_event"] = Summary(t_.evict.to_event);
    j["undecodable_batches"] = events_->undecodable();
  }
  return j;
}

int ExitCode(const Status& s) { return s.code() == StatusCode::kUnavailable ? 3 : 1; }

void PrintLine(const char* what, const nlohmann::json& s) {
  if (!s.contains("p50_us")) return;
  std::printf("%-22s p50 %9.1f us  p99 %9.1f us  max %9.1f us  (%d samples)\n", what,
              s["p50_us"].get<double>(), s["p99_us"].get<double>(), s["max_us"].get<double>(),
              s["samples"].get<int>());
}

}  // namespace

int RunStaleness(const StalenessOptions& o, bool json) {
  StalenessRun run(o);
  if (Status s = run.Connect(); !s.ok()) {
    std::cerr << "kvd-cluster-bench: " << s << "\n";
    return ExitCode(s);
  }
  for (int64_t i = 0; i < o.samples; ++i) {
    if (Status s = run.Sample(); !s.ok()) {
      std::cerr << "kvd-cluster-bench: sample " << i << ": " << s << "\n";
      return ExitCode(s);
    }
  }
  const nlohmann::json j = run.Report();
  if (json) {
    std::cout << j.dump() << "\n";
    return 0;
  }
  for (const char* k : {"put", "commit_to_visible", "commit_to_event", "evict",
                        "evict_to_invisible", "evict_to_event"}) {
    if (j.contains(k)) PrintLine(k, j[k]);
  }
  return 0;
}

int RunMemberWatch(const MemberWatchOptions& o, bool json) {
  auto reader = Client::Connect(o.reader);
  if (!reader.ok()) {
    std::cerr << "kvd-cluster-bench: " << reader.status() << "\n";
    return ExitCode(reader.status());
  }
  const Hash128 chain[1] = {Hash128{0x6b7664, 0x6d656d626572}};
  auto listed = [&](const LookupResult& r) {
    const bool in = std::any_of(r.holders.begin(), r.holders.end(),
                                [&](const auto& h) { return h.node == o.node; });
    return in != o.absent;
  };
  const auto start = Clock::now();
  auto seen = PollUntil(**reader, chain, listed, start + std::chrono::milliseconds(o.wait_ms));
  const int64_t unix_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count();
  if (!seen.ok()) {
    std::cerr << "kvd-cluster-bench: member " << o.node << ": " << seen.status() << "\n";
    return ExitCode(seen.status());
  }
  const nlohmann::json j = {{"ok", true},
                            {"op", "member"},
                            {"node", o.node},
                            {"absent", o.absent},
                            {"seen_unix_ns", unix_ns},
                            {"lookups", seen->lookups},
                            {"waited_ms", Us(seen->at - start) / 1e3}};
  if (json) {
    std::cout << j.dump() << "\n";
  } else {
    std::printf("%s %s after %lld cluster lookups (%.1f ms), at %lld ns since the epoch\n",
                o.node.c_str(), o.absent ? "no longer listed" : "listed",
                static_cast<long long>(seen->lookups), Us(seen->at - start) / 1e3,
                static_cast<long long>(unix_ns));
  }
  return 0;
}

}  // namespace kvd::tools::cluster_bench
