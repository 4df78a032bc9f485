#include "util.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <ostream>

namespace kvd::tools {

std::string HumanBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  else
    std::snprintf(buf, sizeof buf, "%.1f %s", v, kUnits[u]);
  return buf;
}

std::string HumanDuration(uint64_t ms) {
  char buf[48];
  if (ms < 60'000) {
    std::snprintf(buf, sizeof buf, "%.1f s", ms / 1000.0);
    return buf;
  }
  uint64_t m = ms / 60'000, h = m / 60, d = h / 24;
  if (d > 0)
    std::snprintf(buf, sizeof buf, "%llud %lluh %llum", (unsigned long long)d,
                  (unsigned long long)(h % 24), (unsigned long long)(m % 60));
  else if (h > 0)
    std::snprintf(buf, sizeof buf, "%lluh %llum", (unsigned long long)h,
                  (unsigned long long)(m % 60));
  else
    std::snprintf(buf, sizeof buf, "%llum %llus", (unsigned long long)m,
                  (unsigned long long)((ms / 1000) % 60));
  return buf;
}

void PrintTable(std::ostream& os, const std::vector<std::string>& header,
                const std::vector<std::vector<std::string>>& rows) {
  const size_t n = header.size();
  std::vector<size_t> width(n);
  std::vector<bool> right(n, !rows.empty());
  for (size_t c = 0; c < n; ++c) {
    width[c] = header[c].size();
    for (const auto& r : rows) {
      if (c >= r.size()) continue;
      width[c] = std::max(width[c], r[c].size());
      if (r[c].empty() || !std::isdigit(static_cast<unsigned char>(r[c][0]))) right[c] = false;
    }
  }
  auto line = [&](const std::vector<std::string>& cells) {
    std::string out;
    for (size_t c = 0; c < n; ++c) {
      std::string cell = c < cells.size() ? cells[c] : "";
      std::string pad(width[c] - cell.size(), ' ');
      out += right[c] ? pad + cell : cell + pad;
      if (c + 1 < n) out += "  ";
    }
    while (!out.empty() && out.back() == ' ') out.pop_back();
    os << out << "\n";
  };
  line(header);
  for (const auto& r : rows) line(r);
}

void AddConnectionOptions(CLI::App& app, ConnectionFlags* f) {
  app.add_option("--addr", f->addr,
                 "daemon address: host:port or unix:/path (default $KVD_ADDR, else "
                 "127.0.0.1:7400)");
  app.add_option("--ucx-tls", f->ucx_tls, "UCX transports (UCX_TLS), e.g. sm,tcp");
  app.add_option("--net-devices", f->net_devices, "UCX network devices (UCX_NET_DEVICES), e.g. lo");
  app.add_option("--namespace", f->name_space, "cache namespace (default: the daemon's default)");
  app.add_option("--hash-seed", f->hash_seed, "the deployment's hash seed text");
  app.add_option("--client-id", f->client_id, "name shown in the daemon's logs");
  app.add_option("--timeout-ms", f->timeout_ms, "connect and request timeout")
      ->check(CLI::PositiveNumber);
}

void ApplyConnectionFlags(const ConnectionFlags& f, client::ClientOptions* o) {
  if (!f.addr.empty())
    o->address = f.addr;
  else if (const char* env = std::getenv("KVD_ADDR"))
    o->address = env;
  auto& ucx = transport::MutableBackendOptions<transport::UcxOptions>(&o->transport);
  if (!f.ucx_tls.empty()) ucx.ucx_tls = f.ucx_tls;
  if (!f.net_devices.empty()) ucx.net_devices = f.net_devices;
  if (!f.name_space.empty()) o->name_space = f.name_space;
  if (!f.hash_seed.empty()) o->hash_seed = f.hash_seed;
  if (!f.client_id.empty()) o->client_id = f.client_id;
  if (f.timeout_ms > 0) {
    o->connect_timeout_ms = o->request_timeout_ms = f.timeout_ms;
    o->transfer_timeout_ms = std::max<int64_t>(f.timeout_ms, 30000);
  }
}

StatusOr<client::ModelInfo> FindModel(const client::ClientOptions& base, const std::string& model,
                                      uint32_t* chunk_tokens) {
  client::ClientOptions admin = base;
  admin.role = client::Role::kAdmin;
  admin.model.clear();
  KVD_ASSIGN_OR_RETURN(auto c, client::Client::Connect(admin));
  KVD_ASSIGN_OR_RETURN(client::Stats stats, c->GetStats());
  if (chunk_tokens) *chunk_tokens = c->session().chunk_tokens;
  std::string names;
  for (const auto& m : stats.registered_models) {
    if (m.name == model) return m;
    names += (names.empty() ? "" : ", ") + m.name;
  }
  return Status::NotFound("model '" + model + "' is not registered in kvd (registered: " + names +
                          ")");
}

namespace {

std::string R2Cell(double r2, bool routes) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%.3f%s", r2, routes ? "*" : "");
  return buf;
}

std::string Percent(uint64_t part, uint64_t whole) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%.1f%%", whole == 0 ? 0.0 : 100.0 * part / whole);
  return buf;
}

}  // namespace

void PrintCalibration(std::ostream& os, const std::vector<client::CalibrationInfo>& models) {
  if (models.empty()) os << "no model's compression policy routes values (vector)\n";
  for (size_t i = 0; i < models.size(); ++i) {
    const auto& m = models[i];
    if (i > 0) os << "\n";
    os << "model " << m.model << "  state " << m.state << "  codec " << m.codec_id;
    if (m.state == "not-routing") {
      os << "\n  its compression policy does not route values: nothing to calibrate\n";
      continue;
    }
    os << "  tokens " << m.tokens_seen << " / " << m.tokens_needed << " per head ("
       << Percent(std::min(m.tokens_seen, m.tokens_needed), m.tokens_needed) << ")";
    if (m.version != 0) {
      char v[17];
      std::snprintf(v, sizeof v, "%016llx", static_cast<unsigned long long>(m.version));
      os << "  version " << v;
    }
    os << "\n";
    const size_t heads = m.num_kv_heads;
    if (heads == 0 || m.r2.size() != heads * m.num_layers) {
      os << "  R^2 per layer and head once calibrated\n";
      continue;
    }
    size_t routing = 0;
    for (bool r : m.routes) routing += r;
    char threshold[16];
    std::snprintf(threshold, sizeof threshold, "%g", m.r2_threshold);
    os << "R^2 per layer (rows) and KV head (columns); * = the head routes (R^2 >= " << threshold
       << "): " << routing << " of " << m.r2.size() << " heads\n";
    std::vector<std::string> header = {"LAYER"};
    for (size_t h = 0; h < heads; ++h) header.push_back("H" + std::to_string(h));
    std::vector<std::vector<std::string>> rows;
    for (size_t l = 0; l < m.num_layers; ++l) {
      std::vector<std::string> row = {std::to_string(l)};
      for (size_t h = 0; h < heads; ++h) {
        const size_t at = l * heads + h;
        row.push_back(R2Cell(m.r2[at], at < m.routes.size() && m.routes[at]));
      }
      rows.push_back(std::move(row));
    }
    PrintTable(os, header, rows);
  }
}

}  // namespace kvd::tools
