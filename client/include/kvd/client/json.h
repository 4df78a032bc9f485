// JSON forms of the admin views, shared by `kvdctl --json` and the C ABI's *_json calls.
// Byte counts are integers in bytes, times in milliseconds, hashes 32 hex digits.
// Pure functions: thread-safe.
#pragma once

#include <string>

#include "kvd/client/client.h"

namespace kvd::client {

// {"node":..,"uptime_ms":..,"sessions":..,"tiers":[{"name","capacity_bytes","used_bytes",
//  "reserved_bytes","pinned_bytes","chunks","evictions","hits","misses"}],"models":[{"name",
//  "chunks","bytes"}],"namespaces":[...],"registered_models":[{"name","layout","chunk_bytes"}],
//  "counters":{name: value}}
std::string StatsToJson(const Stats& stats, int indent = 2);
// {"total":..,"chunks":[{"namespace","model","hash","tokens","bytes","tier","age_ms","idle_ms",
//  "leases"}]}
std::string ListToJson(const ListResult& list, int indent = 2);
// {"chunks":..,"bytes":..,"skipped_pinned":..}
std::string EvictToJson(const EvictResult& evict, int indent = 2);
// {"ok":..,"status":..,"uptime_ms":..,"transport":..,"tiers":[{"name","ok","detail"}]}
std::string HealthToJson(const Health& health, int indent = 2);
// {"models":[{"model","state","tokens_seen","tokens_needed","version" (16 hex digits, "" while
//  collecting),"codec_id","num_layers","num_kv_heads","r2_threshold","r2":[[R^2 of each KV head]
//  per layer] ([] while collecting),"routes":[[bool per head] per layer],"routing_heads"}]}
std::string CalibrationToJson(const std::vector<CalibrationInfo>& models, int indent = 2);
// One KV cache event: {"seq":..,"event":"stored"|"removed","reason":..(removed only),"tier",
//  "namespace","model","codec_id","layout_digest" (16 hex digits),"hash","tokens","bytes"}, or
//  {"seq":..,"event":"dropped","dropped":N}. kvdctl events prints one per line (indent -1).
std::string EventToJson(const KvEvent& event, int indent = -1);
// A one-line human form of an event (kvdctl events without --json).
std::string EventToText(const KvEvent& event);
// What the daemon granted at the handshake: {"session_id","daemon_version","node",
//  "chunk_tokens","max_frame_bytes","max_chunk_bytes","transport","shared_memory","read_only",
//  "codec_id","policy","window_tokens","needs_queries","keeps_positions","nccl",
//  "cluster_lookup","cluster_placement"}
std::string SessionToJson(const SessionInfo& session, int indent = 2);
// A cluster-scope lookup's holders (LookupResult::holders), this daemon first:
//  [{"node","matched_chunks","error","found_in":[{"tier","chunks"}]}]
std::string HoldersToJson(const std::vector<PrefixHolder>& holders, int indent = -1);
// {"code":"NOT_FOUND","message":...}
std::string StatusToJson(const Status& status, int indent = 2);

}  // namespace kvd::client
