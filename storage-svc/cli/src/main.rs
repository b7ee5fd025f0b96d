//! The `tessera-storage` binary: [`tessera_storage_cli::run`] on this process's arguments.

#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    std::process::ExitCode::from(tessera_storage_cli::run(std::env::args_os()))
}
