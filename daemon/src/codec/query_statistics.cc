// The expected-attention query statistics of a model (a policy with an expected_attention
// stage): created or reloaded at Create, each put's window queries added and saved.
#include <algorithm>
#include <memory>
#include <span>

#include "codec/chunk_codec_impl.h"
#include "codec/query_stats_record.h"
#include "kvd/common/logging.h"

namespace kvd::daemon {

Status ChunkCodec::Impl::StartQueryStatistics() {
  KVD_ASSIGN_OR_RETURN(kk::RopeTable rope,
                       kk::RopeTable::Create(model.layout.rope, model.layout.head_dim));
  KVD_ASSIGN_OR_RETURN(
      kk::QueryStatistics queries,
      kk::QueryStatistics::Create(model.layout.num_layers, model.layout.num_q_heads, rope));
  if (store != nullptr) {
    auto bytes = store->Load(query_record);
    Status bad = bytes.ok() ? Status::Ok() : bytes.status();
    if (bad.ok()) {
      auto saved = DeserializeQueryStatistics(*bytes, model.layout.num_layers,
                                              model.layout.num_q_heads, rope);
      if (saved.ok()) {
        queries = std::move(*saved);
        query_saved = queries.MinCount();
        KVD_LOG(INFO) << "expected-attention query statistics reloaded" << Kv("model", model.name)
                      << Kv("record", store->Where(query_record)) << Kv("queries", query_saved)
                      << Kv("needed", plan.expected_attention_min_queries);
      } else {
        bad = saved.status();
      }
    }
    if (!bad.ok() && bad.code() != StatusCode::kNotFound) {
      KVD_LOG(ERROR) << "saved expected-attention query statistics refused, collecting from zero"
                     << Kv("model", model.name) << Kv("record", store->Where(query_record))
                     << Kv("status", bad);
    }
  }
  query_snapshot = std::make_shared<const kk::QueryStatistics>(std::move(queries));
  return Status::Ok();
}

std::shared_ptr<const kk::QueryStatistics> ChunkCodec::Impl::AddQueries(
    std::span<const uint8_t> query_bytes, uint32_t window, std::span<const int64_t> positions) {
  std::lock_guard lock(query_mu);
  if (window == 0 || !query_snapshot) return query_snapshot;
  const size_t per_layer = query_bytes.size() / model.layout.num_layers;
  const std::span<const int64_t> qpos = positions.subspan(positions.size() - window);
  kk::QueryStatistics next = *query_snapshot;  // the one copy a put makes
  for (int l = 0; l < model.layout.num_layers; ++l) {
    const std::span<const float> q(
        reinterpret_cast<const float*>(query_bytes.data() + per_layer * l),
        per_layer / sizeof(float));
    if (Status s = next.Add(l, q, qpos); !s.ok()) {
      KVD_LOG(WARNING) << "expected-attention statistics skipped a put" << Kv("model", model.name)
                       << Kv("status", s);
      return query_snapshot;
    }
  }
  const bool became_ready = query_snapshot->MinCount() < plan.expected_attention_min_queries &&
                            next.MinCount() >= plan.expected_attention_min_queries;
  query_snapshot = std::make_shared<const kk::QueryStatistics>(std::move(next));
  const kk::QueryStatistics& queries = *query_snapshot;
  if (became_ready) {
    KVD_LOG(INFO) << "expected-attention query statistics ready: chunks are scored with them"
                  << Kv("model", model.name) << Kv("queries", queries.MinCount());
  }
  const int64_t step = std::max<int64_t>(1, plan.expected_attention_min_queries / 8);
  const int64_t count = queries.MinCount();
  if (store != nullptr &&
      (count < plan.expected_attention_min_queries || count - query_saved >= step)) {
    if (Status p = store->Save(query_record, SerializeQueryStatistics(queries)); p.ok()) {
      query_saved = count;
    } else {
      KVD_LOG(WARNING) << "expected-attention query statistics not saved" << Kv("model", model.name)
                       << Kv("status", p);
    }
  }
  return query_snapshot;
}

}  // namespace kvd::daemon
