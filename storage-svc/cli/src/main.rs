//! The `tessera-storage` binary: [`tessera_storage_cli::run`] on this process's arguments.

#![forbid(unsafe_code)]

/// mimalloc: glibc's allocator gives back the top of its heap as soon as more than 128 KiB
/// of it is free, so a request that allocates and frees more (the descriptors and values of a
/// batch of a thousand tensors) faulted its pages in again each time.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    std::process::ExitCode::from(tessera_storage_cli::run(std::env::args_os()))
}
