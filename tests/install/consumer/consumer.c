/* Out-of-tree C consumer of an installed libkvd_client (C ABI): put one chunk, look it up,
 * read it back byte-exact. Usage: consumer_c HOST:PORT. Exit 0 on success, 1 otherwise. */
#include <kvd/client/kvd_client.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(const char* what, int code) {
  fprintf(stderr, "%s: %s (%s)\n", what, kvd_error_name(code), kvd_last_error());
  return 1;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: consumer_c HOST:PORT\n");
    return 1;
  }
  if (kvd_client_abi_version() != KVD_CLIENT_ABI_VERSION) {
    fprintf(stderr, "loaded libkvd_client has ABI %d, the header %d\n", kvd_client_abi_version(),
            KVD_CLIENT_ABI_VERSION);
    return 1;
  }
  kvd_config cfg;
  kvd_config_init(&cfg);
  cfg.address = argv[1];
  cfg.client_id = "consumer-c";
  cfg.model = "stories260k";
  cfg.layout.num_layers = 5;
  cfg.layout.num_kv_heads = 4;
  cfg.layout.num_q_heads = 8;
  cfg.layout.head_dim = 8;
  cfg.layout.dtype = KVD_DTYPE_FLOAT32;
  cfg.layout.rope_theta = 10000;
  cfg.layout.rope_pairing = KVD_ROPE_INTERLEAVED;
  cfg.ucx_tls = "sm,tcp";
  cfg.net_devices = "lo";
  kvd_client* c = NULL;
  int rc = kvd_client_connect(&cfg, &c);
  if (rc != KVD_OK) return fail("connect", rc);

  int32_t tokens[256];
  for (int i = 0; i < 256; ++i) tokens[i] = 3 * i + 2;
  kvd_hash128 chain[1];
  size_t count = 0;
  rc = kvd_client_chunk_chain(c, tokens, 256, 1, chain, 1, &count);
  if (rc != KVD_OK) return fail("chunk_chain", rc);
  /* 256 tokens x 5 layers x (K + V) x 4 heads x 8 dims x 4 bytes */
  const size_t bytes = (size_t)256 * 5 * 2 * 4 * 8 * 4;
  unsigned char* in = malloc(bytes);
  unsigned char* out = malloc(bytes);
  for (size_t i = 0; i < bytes; ++i) in[i] = (unsigned char)(i * 17 + 3);
  rc = kvd_client_put(c, chain[0], 256, in, bytes, NULL);
  if (rc != KVD_OK) return fail("put", rc);
  kvd_lookup_result hit;
  kvd_lookup_result_init(&hit);
  rc = kvd_client_lookup(c, chain, 1, &hit);
  if (rc != KVD_OK) return fail("lookup", rc);
  if (hit.matched_chunks != 1) {
    fprintf(stderr, "lookup matched %u chunks\n", hit.matched_chunks);
    return 1;
  }
  kvd_get_result got;
  kvd_get_result_init(&got);
  rc = kvd_client_get(c, hit.lease_id, 0, out, bytes, &got);
  if (rc != KVD_OK) return fail("get", rc);
  if (got.bytes != bytes || memcmp(in, out, bytes) != 0) {
    fprintf(stderr, "get: bytes differ\n");
    return 1;
  }
  rc = kvd_client_release_lease(c, hit.lease_id);
  if (rc != KVD_OK) return fail("release", rc);
  kvd_client_close(c);
  free(in);
  free(out);
  printf("consumer_c ok: %zu bytes round-tripped\n", bytes);
  return 0;
}
