/* A stand-in for the driver's libnvidia-ml.so.1, for tests on machines without a GPU: the
 * symbols rsb-nvml calls, with the NVML ABI's types and return codes. FAKE_NVML=ok serves two
 * GPUs (GPU 1 has no utilisation reading, GPU 0 one compute process); anything else fails
 * nvmlInit_v2 with NVML_ERROR_DRIVER_NOT_LOADED (9), as a host whose driver is not loaded. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
typedef void *nvmlDevice_t;

static int ok(void) {
  const char *m = getenv("FAKE_NVML");
  return m && strcmp(m, "ok") == 0;
}
static int idx(nvmlDevice_t d) { return (int)(long)d - 1; }

nvmlReturn_t nvmlInit_v2(void) { return ok() ? 0 : 9; }
nvmlReturn_t nvmlShutdown(void) { return 0; }
const char *nvmlErrorString(nvmlReturn_t r) { return r == 9 ? "Driver Not Loaded" : "Unknown Error"; }
nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned n) {
  snprintf(v, n, "550.54.15");
  return 0;
}
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *c) {
  *c = 2;
  return 0;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned i, nvmlDevice_t *d) {
  if (i > 1) return 2;
  *d = (void *)(long)(i + 1);
  return 0;
}
nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned *i) {
  *i = idx(d);
  return 0;
}
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *n, unsigned len) {
  snprintf(n, len, "NVIDIA Fake H100");
  return 0;
}
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *u, unsigned len) {
  snprintf(u, len, "GPU-fake-%d", idx(d));
  return 0;
}
typedef struct { unsigned gpu, memory; } util_t;
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, util_t *u) {
  if (idx(d) == 1) return 3; /* NOT_SUPPORTED */
  u->gpu = 37;
  u->memory = 5;
  return 0;
}
typedef struct { unsigned version; unsigned long long total, reserved, free, used; } mem2_t;
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, mem2_t *m) {
  m->total = 81920ULL << 20;
  m->reserved = 0;
  m->used = (idx(d) ? 0ULL : 1024ULL) << 20;
  m->free = m->total - m->used;
  return 0;
}
nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned *t) {
  *t = 41;
  return 0;
}
nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned *p) {
  *p = 123450;
  return 0;
}
nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t d, unsigned long long *e) {
  *e = 987654;
  return 0;
}
typedef struct { unsigned pid; unsigned long long used; unsigned gi, ci; } proc_t;
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned *count, proc_t *p) {
  if (idx(d) != 0) {
    *count = 0;
    return 0;
  }
  if (*count < 1 || !p) {
    *count = 1;
    return 7; /* INSUFFICIENT_SIZE */
  }
  p[0].pid = 4242;
  p[0].used = 500ULL << 20;
  p[0].gi = 0xFFFFFFFF;
  p[0].ci = 0xFFFFFFFF;
  *count = 1;
  return 0;
}
nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned *cur, unsigned *pend) { return 3; }
