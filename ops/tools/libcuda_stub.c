/* libcuda.so.1 for a machine without an NVIDIA driver (ops/tools/install-mooncake.sh).
 *
 * Mooncake's wheel links its binaries against the CUDA driver even for its TCP transport. Every
 * entry point they name answers CUDA_ERROR_NO_DEVICE (100), so they take their host-memory
 * paths. The list is what `nm -D --undefined-only` shows for store.so, engine.so,
 * mooncake_client and mooncake_master (mooncake-transfer-engine 0.3.13.post1). A machine with a
 * real driver does not build this file.
 */
#define CUDA_ERROR_NO_DEVICE 100

int cuGetErrorName(int error, const char **name) {
    (void)error;
    if (name) *name = "CUDA_ERROR_NO_DEVICE";
    return 0;
}

int cuGetErrorString(int error, const char **text) {
    (void)error;
    if (text) *text = "no CUDA device (kvledger's libcuda stub: this machine has no NVIDIA driver)";
    return 0;
}

#define NO_DEVICE(name) int name(void) { return CUDA_ERROR_NO_DEVICE; }
NO_DEVICE(cuInit)
NO_DEVICE(cuCtxGetDevice)
NO_DEVICE(cuCtxSetCurrent)
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuDeviceGetAttribute)
NO_DEVICE(cuDevicePrimaryCtxRelease_v2)
NO_DEVICE(cuDevicePrimaryCtxRetain)
NO_DEVICE(cuMemAddressFree)
NO_DEVICE(cuMemAddressReserve)
NO_DEVICE(cuMemCreate)
NO_DEVICE(cuMemExportToShareableHandle)
NO_DEVICE(cuMemGetAddressRange_v2)
NO_DEVICE(cuMemGetAllocationGranularity)
NO_DEVICE(cuMemGetHandleForAddressRange)
NO_DEVICE(cuMemImportFromShareableHandle)
NO_DEVICE(cuMemMap)
NO_DEVICE(cuMemRelease)
NO_DEVICE(cuMemSetAccess)
NO_DEVICE(cuMemUnmap)
NO_DEVICE(cuPointerGetAttribute)
NO_DEVICE(cuPointerSetAttribute)
