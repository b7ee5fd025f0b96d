//! The binary against hostile setups: a backend that cannot work across processes, tokens
//! that other users could read, files at the unit's socket path, a low open-file limit.
//! Every wait is a hang guard, not a timing assertion.

mod common;

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use tessera_storage::{Backend, Client, ClientConfig};

const BIN: &str = env!("CARGO_BIN_EXE_tessera-storage");

/// Waits for `child` at most `guard`, killing it then (and failing).
fn finish(mut child: Child, guard: Duration) -> Output {
    let start = std::time::Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > guard {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "still running after {guard:?}; stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let child = Command::new(BIN)
        .args(args)
        .env_remove("TESSERA_TOKEN")
        .envs(envs.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    finish(child, Duration::from_secs(60))
}

/// A unit started with `args`, announcing its address; killed on drop.
struct Unit(Child, String);

impl Unit {
    fn start(args: &[&str], envs: &[(&str, &str)]) -> Self {
        let mut child = Command::new(BIN)
            .args(["serve", "--announce"])
            .args(args)
            .env_remove("TESSERA_TOKEN")
            .envs(envs.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let addr = common::announced(&mut child);
        Unit(child, addr)
    }
}

impl Drop for Unit {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Finding: `serve --backend inproc` and `put/get --backend inproc` in two processes both
/// exited 0 and the file read back was all zeros. The binary refuses the backend.
#[test]
fn inproc_is_refused_by_serve_and_the_client_commands() {
    let serve = run(
        &["serve", "--backend", "inproc", "--bind", "127.0.0.1:0"],
        &[],
    );
    let put = run(
        &[
            "put",
            "--backend",
            "inproc",
            "--partition",
            "p",
            "--index",
            "1",
            "--field",
            "x",
            "--value",
            "v",
        ],
        &[],
    );
    let get = run(
        &[
            "get",
            "--backend",
            "inproc",
            "--partition",
            "p",
            "--index",
            "1",
            "--field",
            "x",
        ],
        &[],
    );
    for (what, out) in [("serve", serve), ("put", put), ("get", get)] {
        assert!(!out.status.success(), "{what} --backend inproc succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("within one process only"), "{what}: {err}");
    }
}

/// Finding: the token could only be given as `--token`, visible to every user in
/// /proc/PID/cmdline. `--token-file` and `TESSERA_TOKEN` keep it off the command line, for
/// the unit and the client commands.
#[test]
fn the_token_comes_from_a_file_or_the_environment() {
    let secret = "a-token-no-one-else-sees";
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("token");
    std::fs::write(&file, format!("{secret}\n")).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let file = file.to_str().unwrap();
    let unit = Unit::start(&["--bind", "127.0.0.1:0", "--token-file", file], &[]);
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", unit.0.id())).unwrap();
    assert!(!cmdline
        .windows(secret.len())
        .any(|w| w == secret.as_bytes()));
    let stats = |envs: &[(&str, &str)], extra: &[&str]| {
        let mut args = vec!["stats", "--unit", &unit.1];
        args.extend_from_slice(extra);
        run(&args, envs)
    };
    assert!(stats(&[("TESSERA_TOKEN", secret)], &[]).status.success());
    assert!(stats(&[], &["--token-file", file]).status.success());
    let without = stats(&[], &[]);
    assert!(!without.status.success());
    assert!(
        String::from_utf8_lossy(&without.stderr).contains("token"),
        "{}",
        String::from_utf8_lossy(&without.stderr)
    );
    // A token file others may read is refused.
    std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let exposed = stats(&[], &["--token-file", file]);
    assert!(!exposed.status.success());
    assert!(String::from_utf8_lossy(&exposed.stderr).contains("chmod 600"));
    // The flag stays, documented as visible to other users.
    let help = run(&["serve", "--help"], &[]);
    assert!(String::from_utf8_lossy(&help.stdout).contains("/proc"));
}

/// Finding: `--bind unix:PATH` unlinked whatever file was at PATH. Only a stale socket is
/// removed; a regular file or a live socket is a clear error and stays.
#[test]
fn bind_unix_removes_only_a_stale_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("unit.sock");
    let bind = format!("unix:{}", path.display());
    std::fs::write(&path, "precious").unwrap();
    let out = run(&["serve", "--bind", &bind], &[]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not a socket"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "precious");
    std::fs::remove_file(&path).unwrap();
    // A live socket: another process (here, this test) accepts on it.
    let live = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let out = run(&["serve", "--bind", &bind], &[]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("live socket"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(std::os::unix::net::UnixStream::connect(&path).is_ok());
    drop(live);
    // Now stale: the file stays, nobody accepts. The unit takes the path over.
    assert!(path.exists());
    let unit = Unit::start(&["--bind", &bind], &[]);
    assert_eq!(unit.1, bind);
}

/// Finding: at `nofile=1024` about 1,000 idle sockets locked out new clients and the unit
/// logged "accept failed" in a loop. The unit raises its soft limit to the hard one at
/// start: with a soft limit of 128, 300 idle connections do not lock a client out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sockets_at_a_low_soft_nofile_do_not_lock_clients_out() {
    let hard = rlimit_hard();
    if hard < 1024 {
        eprintln!("the hard open-file limit ({hard}) is too low for this test; skipped");
        return;
    }
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -Sn 128 && exec {BIN} serve --announce --bind 127.0.0.1:0 --backend shm"
        ))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let addr = common::announced(&mut child);
    let unit = Unit(child, addr.clone());
    let idle: Vec<_> = (0..300)
        .map(|_| std::net::TcpStream::connect(&addr).unwrap())
        .collect();
    let c = Client::connect(ClientConfig {
        units: vec![addr],
        backend: Backend::Shm,
        recv_pool_bytes: 1 << 20,
        timeout: Duration::from_secs(30),
        ..ClientConfig::default()
    })
    .await
    .expect("a client is locked out by idle sockets");
    let st = &c.stats().await.unwrap()[0];
    assert_eq!(st.accept_errors, 0, "{st:?}");
    assert!(st.connections >= 301, "{st:?}");
    drop((idle, c));
    drop(unit);
}

fn rlimit_hard() -> u64 {
    let mut s = String::new();
    Command::new("sh")
        .args(["-c", "ulimit -Hn"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut s)
        .unwrap();
    s.trim().parse().unwrap_or(u64::MAX)
}
