/* A stand-in for the NVIDIA driver's libcuda.so.1, so that what the preflight and
   install.sh say about GPUs is tested on machines without one. It reports the GPUs
   listed in FAKE_CUDA_GPUS, e.g. "NVIDIA H100 80GB HBM3=9.0;NVIDIA A100-SXM4-40GB=8.0",
   each optionally with its PCI bus id ("NVIDIA A100=8.0@0000:3b:00.0"; by default
   0000:<ordinal>:00.0); FAKE_CUDA_INIT makes cuInit return that error code instead. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Copies GPU `index`'s name into `name`, its capability into major/minor and its bus
   id (if `bus` is not NULL) into `bus`; returns the number of GPUs listed when index is
   -1, or -1 past the end. */
static int gpu_with_bus(int index, char *name, int length, int *major, int *minor,
                        char *bus, int bus_length) {
    const char *list = getenv("FAKE_CUDA_GPUS");
    int count = 0;
    while (list && *list) {
        const char *end = strchr(list, ';'), *equals = strchr(list, '=');
        if (!end) end = list + strlen(list);
        if (count == index && equals && equals < end) {
            const char *at = strchr(equals, '@');
            snprintf(name, length, "%.*s", (int)(equals - list), list);
            sscanf(equals + 1, "%d.%d", major, minor);
            if (bus && at && at < end)
                snprintf(bus, bus_length, "%.*s", (int)(end - at - 1), at + 1);
            else if (bus)
                snprintf(bus, bus_length, "0000:%02x:00.0", index);
            return count;
        }
        count++;
        list = *end ? end + 1 : end;
    }
    return index < 0 ? count : -1;
}

static int gpu(int index, char *name, int length, int *major, int *minor) {
    return gpu_with_bus(index, name, length, major, minor, NULL, 0);
}

int cuInit(unsigned int flags) {
    (void)flags;
    const char *forced = getenv("FAKE_CUDA_INIT");
    if (forced) return atoi(forced);
    return gpu(-1, NULL, 0, NULL, NULL) > 0 ? 0 : 100; /* CUDA_ERROR_NO_DEVICE */
}

int cuDriverGetVersion(int *version) { *version = 12040; return 0; }

int cuDeviceGetCount(int *count) { *count = gpu(-1, NULL, 0, NULL, NULL); return 0; }

int cuDeviceGet(int *device, int ordinal) { *device = ordinal; return 0; }

int cuDeviceGetName(char *name, int length, int device) {
    int major, minor;
    return gpu(device, name, length, &major, &minor) < 0 ? 101 : 0; /* INVALID_DEVICE */
}

int cuDeviceGetAttribute(int *value, int attribute, int device) {
    char name[256];
    int major = 0, minor = 0;
    if (gpu(device, name, sizeof name, &major, &minor) < 0) return 101;
    if (attribute == 75) *value = major;      /* COMPUTE_CAPABILITY_MAJOR */
    else if (attribute == 76) *value = minor; /* COMPUTE_CAPABILITY_MINOR */
    else return 1;                            /* CUDA_ERROR_INVALID_VALUE */
    return 0;
}

int cuDeviceGetPCIBusId(char *bus, int length, int device) {
    char name[256];
    int major = 0, minor = 0;
    return gpu_with_bus(device, name, sizeof name, &major, &minor, bus, length) < 0 ? 101 : 0;
}
