#include "daemon_bench.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "kvd/common/cli.h"
#include "pingpong_bench.h"
#include "util.h"

namespace kvd::tools::bench {
namespace {

// --in-place put of one chunk: reserve, write the slot (the engine's own write), commit.
Status PutInPlace(kvd::client::Client& c, const kvd::client::PutItem& item) {
  auto slot = c.ReservePut(item.hash, item.tokens, item.bytes);
  if (!slot.ok()) return slot.status();
  if (!slot->already_stored()) std::memcpy(slot->data(), item.data, item.bytes);
  return c.CommitPut(std::move(slot).value()).status();
}

double MicrosSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

}  // namespace

int DaemonBench::Connect() {
  clients_.resize(nthreads_);
  for (int t = 0; t < nthreads_; ++t) {
    auto c = kvd::client::Client::Connect(base_);
    if (!c.ok()) {
      std::cerr << "kvd-bench: connect: " << c.status() << "\n";
      return c.status().code() == kvd::StatusCode::kUnavailable ? 3 : 1;
    }
    clients_[t] = std::move(c).value();
  }
  put_clients_.resize(f_.put_addr.empty() ? 0 : nthreads_);
  for (auto& pc : put_clients_) {
    kvd::client::ClientOptions o = base_;
    o.address = f_.put_addr;
    auto c = kvd::client::Client::Connect(o);
    if (!c.ok()) {
      std::cerr << "kvd-bench: connect to --put-addr: " << c.status() << "\n";
      return c.status().code() == kvd::StatusCode::kUnavailable ? 3 : 1;
    }
    pc = std::move(c).value();
  }
  return -1;
}

PhaseResult DaemonBench::RunPhase(const std::string& name, const PhaseBody& body) {
  PhaseResult result;
  result.name = name;
  std::vector<std::thread> threads;
  std::fill(own_s_.begin(), own_s_.end(), 0.0);
  std::vector<double> busy_s(nthreads_, 0.0);
  std::optional<kvd::tools::ProcSample> before;
  if (f_.daemon_pid > 0) {
    auto s = kvd::tools::SampleProcess(static_cast<pid_t>(f_.daemon_pid));
    if (s.ok()) before = *s;
  }
  auto start = Clock::now();
  for (int t = 0; t < nthreads_; ++t) {
    threads.emplace_back([&, t]() {
      ThreadTally tally;
      Status s = body(t, tally);
      busy_s[t] = std::chrono::duration<double>(Clock::now() - start).count() - own_s_[t];
      std::lock_guard<std::mutex> lock(mu_);
      if (!s.ok() && first_error_.ok()) first_error_ = s.WithContext(name);
      result.latencies_us.insert(result.latencies_us.end(), tally.latencies_us.begin(),
                                 tally.latencies_us.end());
      result.ops += tally.ops;
      result.bytes += tally.bytes;
    });
  }
  for (auto& th : threads) th.join();
  result.wall_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  result.seconds = *std::max_element(busy_s.begin(), busy_s.end());
  if (before) {
    auto after = kvd::tools::SampleProcess(static_cast<pid_t>(f_.daemon_pid));
    if (after.ok()) result.daemon = kvd::tools::Delta(*before, *after);
  }
  return result;
}

kvd::StatusOr<std::vector<kvd::client::PutResult>> DaemonBench::PutChunks(
    int t, std::span<const kvd::client::PutItem> items) {
  auto r = Writer(t).PutChunks(items);
  while (f_.retry_busy && !r.ok() && r.status().code() == kvd::StatusCode::kResourceExhausted) {
    ++busy_retries_[t];
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    r = Writer(t).PutChunks(items);
  }
  return r;
}

// Each round: put, look up, get and release one chunk of this thread's own warmup keys (those of
// another run value, never the timed phases').
Status DaemonBench::WarmupThread(int t, ThreadTally& tally) {
  const uint64_t warmup_run = run_ ^ 0x7761726d75702121ull;
  OwnBuffers buf(2, chunk_bytes_, &own_s_[t]);  // the put's source, the get's destination
  for (int64_t i = 0; i < f_.warmup; ++i) {
    const uint64_t index = static_cast<uint64_t>(t) * f_.warmup + i;
    const kvd::Hash128 hash = ChunkHash(warmup_run, index);
    auto fill0 = Clock::now();
    fill_(buf[0], chunk_bytes_, warmup_run, index);
    const kvd::client::PutItem item{hash, static_cast<int>(tokens_), buf[0], chunk_bytes_};
    auto t0 = Clock::now();
    own_s_[t] += std::chrono::duration<double>(t0 - fill0).count();
    auto r = PutChunks(t, {&item, 1});
    if (!r.ok()) return r.status();
    auto l = clients_[t]->Lookup({&hash, 1});
    if (!l.ok()) return l.status();
    if (l->matched_chunks != 1) {
      return Status::NotFound("warmup chunk " + std::to_string(index) +
                              " missing right after its put");
    }
    const kvd::client::GetItem get{0, buf[1], chunk_bytes_};
    auto g = clients_[t]->GetChunks(l->lease_id, {&get, 1});
    if (!g.ok()) return g.status();
    KVD_RETURN_IF_ERROR(clients_[t]->ReleaseLease(l->lease_id));
    tally.latencies_us.push_back(MicrosSince(t0));
    ++tally.ops;
    tally.bytes += 2 * chunk_bytes_;
  }
  return Status::Ok();
}

// This thread's chunks, --depth per PutChunks call (or one in place).
Status DaemonBench::PutThread(int t, ThreadTally& tally) {
  const size_t depth = static_cast<size_t>(f_.depth);
  auto idx = Indices(t);
  OwnBuffers bufs(depth, chunk_bytes_, &own_s_[t]);
  for (size_t i = 0; i < idx.size(); i += depth) {
    size_t n = std::min<size_t>(depth, idx.size() - i);
    std::vector<kvd::client::PutItem> items(n);
    auto fill0 = Clock::now();
    for (size_t j = 0; j < n; ++j) {
      fill_(bufs[j], chunk_bytes_, run_, idx[i + j]);
      items[j] = {ChunkHash(run_, idx[i + j]), static_cast<int>(tokens_), bufs[j], chunk_bytes_};
    }
    auto t0 = Clock::now();
    own_s_[t] += std::chrono::duration<double>(t0 - fill0).count();
    if (f_.in_place) {  // n == 1
      KVD_RETURN_IF_ERROR(PutInPlace(Writer(t), items[0]));
      tally.latencies_us.push_back(MicrosSince(t0));
      ++tally.ops;
      tally.bytes += chunk_bytes_;
      continue;
    }
    auto r = PutChunks(t, items);
    tally.latencies_us.push_back(MicrosSince(t0));
    if (!r.ok()) return r.status();
    tally.ops += n;
    tally.bytes += n * chunk_bytes_;
  }
  return Status::Ok();
}

// One Lookup per --lookup-chain chunks of this thread, or its share of --lookups calls.
Status DaemonBench::LookupThread(int t, ThreadTally& tally) {
  const size_t lookup_chain = static_cast<size_t>(f_.lookup_chain);
  const int64_t lookups = f_.lookups;
  auto idx = Indices(t);
  // The chain starts of this thread, in turn, as many as --lookups asks of it (the
  // threads share the calls: thread t makes lookups / nthreads, one more for t below
  // the remainder); by default each chain once.
  std::vector<size_t> starts;
  for (size_t b = 0; b < idx.size(); b += lookup_chain) starts.push_back(b);
  const size_t calls = lookups == 0
                           ? starts.size()
                           : static_cast<size_t>(lookups / nthreads_ + (t < lookups % nthreads_));
  for (size_t c = 0; c < calls && !starts.empty(); ++c) {
    const size_t b = starts[c % starts.size()];
    size_t nb = std::min<size_t>(lookup_chain, idx.size() - b);
    std::vector<kvd::Hash128> chain(nb);
    for (size_t j = 0; j < nb; ++j) chain[j] = ChunkHash(run_, idx[b + j]);
    auto t0 = Clock::now();
    auto r = clients_[t]->Lookup(chain, lookup_options_);
    tally.latencies_us.push_back(MicrosSince(t0));
    if (!r.ok()) return r.status();
    if (r->matched_chunks != nb) {
      return Status::NotFound("chunk " + std::to_string(idx[b + r->matched_chunks]) +
                              " missing at lookup (evicted? "
                              "the host tier may be smaller than count x chunk bytes)");
    }
    ++tally.ops;
    tally.bytes += r->fetched_chunks * chunk_bytes_;
    KVD_RETURN_IF_ERROR(clients_[t]->ReleaseLease(r->lease_id));
  }
  return Status::Ok();
}

// As an engine reads a prompt: one Lookup (one lease) for a run of up to --lookup-batch chunks,
// then Gets of --depth chunks per call, then one ReleaseLease. The latency is per Get call; the
// throughput counts the whole phase (lookups and releases included).
Status DaemonBench::GetThread(int t, ThreadTally& tally) {
  const size_t lookup_batch = static_cast<size_t>(f_.lookup_batch);
  auto idx = Indices(t);
  OwnBuffers bufs(f_.depth, chunk_bytes_, &own_s_[t]);
  OwnBuffers expect(f_.verify ? 1 : 0, chunk_bytes_, &own_s_[t]);
  for (size_t b = 0; b < idx.size(); b += lookup_batch) {
    size_t nb = std::min<size_t>(lookup_batch, idx.size() - b);
    std::vector<kvd::Hash128> chain(nb);
    for (size_t j = 0; j < nb; ++j) chain[j] = ChunkHash(run_, idx[b + j]);
    auto l = clients_[t]->Lookup(chain, lookup_options_);
    if (!l.ok()) return l.status();
    if (l->matched_chunks != nb) {
      return Status::NotFound("only " + std::to_string(l->matched_chunks) + " of " +
                              std::to_string(nb) + " chunks found at get");
    }
    if (f_.in_place) {
      KVD_RETURN_IF_ERROR(ReadBatchInPlace(t, idx, b, nb, l->lease_id, expect, tally));
    } else {
      KVD_RETURN_IF_ERROR(ReadBatchCopies(t, idx, b, nb, l->lease_id, bufs, expect, tally));
    }
    KVD_RETURN_IF_ERROR(clients_[t]->ReleaseLease(l->lease_id));
  }
  return Status::Ok();
}

Status DaemonBench::ReadBatchInPlace(int t, const std::vector<uint64_t>& idx, size_t b, size_t nb,
                                     uint64_t lease_id, OwnBuffers& expect, ThreadTally& tally) {
  for (size_t i = 0; i < nb; ++i) {
    auto t0 = Clock::now();
    auto v = clients_[t]->ReadInPlace(lease_id, static_cast<uint32_t>(i));
    if (!v.ok()) return v.status();
    tally.latencies_us.push_back(MicrosSince(t0));
    if (f_.verify) {
      auto v0 = Clock::now();
      fill_(expect[0], chunk_bytes_, run_, idx[b + i]);
      if (v->size() != chunk_bytes_ || std::memcmp(expect[0], v->data(), chunk_bytes_) != 0) {
        return Status::DataLoss("chunk " + std::to_string(idx[b + i]) + " differs");
      }
      own_s_[t] += std::chrono::duration<double>(Clock::now() - v0).count();
    }
    v->Release();  // ends the read with the next request
    ++tally.ops;
    tally.bytes += chunk_bytes_;
  }
  return Status::Ok();
}

Status DaemonBench::ReadBatchCopies(int t, const std::vector<uint64_t>& idx, size_t b, size_t nb,
                                    uint64_t lease_id, OwnBuffers& bufs, OwnBuffers& expect,
                                    ThreadTally& tally) {
  const size_t depth = static_cast<size_t>(f_.depth);
  for (size_t i = 0; i < nb; i += depth) {
    size_t n = std::min<size_t>(depth, nb - i);
    std::vector<kvd::client::GetItem> items(n);
    for (size_t j = 0; j < n; ++j) {
      items[j] = {static_cast<uint32_t>(i + j), bufs[j], chunk_bytes_};
    }
    auto t0 = Clock::now();
    auto r = clients_[t]->GetChunks(lease_id, items);
    tally.latencies_us.push_back(MicrosSince(t0));
    if (!r.ok()) return r.status();
    if (f_.verify) {
      auto v0 = Clock::now();
      for (size_t j = 0; j < n; ++j) {
        fill_(expect[0], chunk_bytes_, run_, idx[b + i + j]);
        if (std::memcmp(expect[0], bufs[j], chunk_bytes_) != 0) {
          return Status::DataLoss("chunk " + std::to_string(idx[b + i + j]) + " differs");
        }
      }
      own_s_[t] += std::chrono::duration<double>(Clock::now() - v0).count();
    }
    tally.ops += n;
    tally.bytes += n * chunk_bytes_;
  }
  return Status::Ok();
}

void DaemonBench::RunPhases() {
  if (f_.warmup > 0) {
    phases_.push_back(
        RunPhase("warmup", [this](int t, ThreadTally& tally) { return WarmupThread(t, tally); }));
    TakeBusyRetries();
  }
  if (first_error_.ok()) {
    phases_.push_back(
        RunPhase("put", [this](int t, ThreadTally& tally) { return PutThread(t, tally); }));
    TakeBusyRetries();
  }
  const bool reads = f_.op != "put";
  if (reads && first_error_.ok() && f_.pingpong_floor > 0 &&
      !PingPongPhases(f_.pingpong_floor, &phases_)) {
    first_error_ = Status::Internal("the --pingpong-floor ping-pong failed");
  }
  if (reads && first_error_.ok()) {
    phases_.push_back(
        RunPhase("lookup", [this](int t, ThreadTally& tally) { return LookupThread(t, tally); }));
  }
  if (reads && first_error_.ok()) {
    phases_.push_back(
        RunPhase("get", [this](int t, ThreadTally& tally) { return GetThread(t, tally); }));
  }
}

int DaemonBench::Report() {
  const bool shm_used = !clients_.empty() && clients_[0] && clients_[0]->session().shared_memory;
  clients_.clear();
  put_clients_.clear();

  const std::string tls =
      transport::BackendOptionsOf<transport::UcxOptions>(base_.transport).ucx_tls;
  nlohmann::json j = {{"model", f_.model},
                      {"chunk_bytes", chunk_bytes_},
                      {"tokens", tokens_},
                      {"count", f_.count},
                      {"concurrency", nthreads_},
                      {"depth", f_.depth},
                      {"op", f_.op},
                      {"ucx_tls", tls},
                      {"ok", first_error_.ok()}};
  const size_t inline_limit = shm_used
                                  ? std::min(base_.inline_put_bytes, base_.shm_inline_put_bytes)
                                  : base_.inline_put_bytes;
  j["shared_memory"] = shm_used;
  j["in_place"] = f_.in_place;
  j["inline_put_bytes"] = inline_limit;
  j["inline_puts"] = chunk_bytes_ <= inline_limit;
  j["lookup_chain"] = f_.lookup_chain;
  j["cluster"] = f_.cluster;
  if (!f_.put_addr.empty()) j["put_addr"] = f_.put_addr;
  j["reply_spin_us"] = base_.reply_spin_us;
  if (f_.lookups > 0) j["lookups"] = f_.lookups;
  if (f_.pingpong_floor > 0) j["pingpong_floor"] = f_.pingpong_floor;
  if (f_.daemon_pid > 0) j["daemon_pid"] = f_.daemon_pid;
  if (!first_error_.ok()) j["error"] = first_error_.ToString();
  if (f_.warmup > 0) j["warmup_rounds"] = f_.warmup;
  if (f_.op == "get") {  // the untimed put
    phases_.erase(std::remove_if(phases_.begin(), phases_.end(),
                                 [](const PhaseResult& p) { return p.name == "put"; }),
                  phases_.end());
  }
  PrintPhases(phases_, std::move(j), f_.json,
              "kvd-bench: model " + f_.model + ", " + kvd::tools::HumanBytes(chunk_bytes_) +
                  " chunks (" + std::to_string(tokens_) + " tokens), count " +
                  std::to_string(f_.count) + ", concurrency " + std::to_string(nthreads_) +
                  ", depth " + std::to_string(f_.depth) + ", ucx_tls '" + tls + "'" +
                  (shm_used ? ", shared memory" : "") + (f_.in_place ? ", in place" : "") +
                  (chunk_bytes_ <= inline_limit ? ", inline puts" : ""));
  if (!first_error_.ok()) {
    std::cerr << "kvd-bench: " << first_error_ << "\n";
    return 1;
  }
  return 0;
}

int RunAgainstDaemon(const CLI::App& app, const BenchFlags& f) {
  if (f.model.empty()) return kvd::cli::UsageError(app, "--model is required");
  if ((f.tokens > 0) == (f.chunk_bytes_arg > 0)) {
    return kvd::cli::UsageError(app, "give exactly one of --chunk-bytes and --tokens");
  }
  kvd::client::ClientOptions base;
  kvd::tools::ApplyConnectionFlags(f.connection, &base);
  ChunkShape shape;
  if (int rc = ConfigureClients(app, f, &base, &shape); rc >= 0) return rc;
  DaemonBench bench(f, base, shape);
  if (int rc = bench.Connect(); rc >= 0) return rc;
  bench.RunPhases();
  return bench.Report();
}

}  // namespace kvd::tools::bench
