//! The binary as a user runs it: what each command prints on success, the exit code and the
//! one error line on failure, and what its flags accept.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};

use common::UnitProcess;
use tessera_storage::Backend;

fn exe() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tessera-storage"));
    cmd.env_remove("TESSERA_TOKEN").env_remove("RUST_LOG");
    cmd
}

fn run(args: &[&str]) -> Output {
    exe().args(args).output().expect("run tessera-storage")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A failed command: exit code 1, one `error:` line first on stderr, nothing on stdout.
fn failed(o: &Output) -> String {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(1), "stderr: {err}");
    assert!(stdout(o).is_empty(), "{}", stdout(o));
    assert!(err.starts_with("error: "), "{err}");
    assert_eq!(err.matches("error:").count(), 1, "{err}");
    err
}

/// A refused command line: clap's exit code 2 and its message.
fn refused(o: &Output) -> String {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "stderr: {err}");
    err
}

fn token_file(dir: &tempfile::TempDir, token: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.path().join("token");
    std::fs::write(&path, token).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path.to_str().unwrap().to_owned()
}

/// The line `serve` (started by `cmd`, with `args`) prints first; it is stopped then.
fn serve_line(mut cmd: Command, args: &[&str]) -> String {
    let mut child = cmd
        .arg("serve")
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    line
}

#[test]
fn serve_says_where_it_listens_and_quiet_silences_it() {
    let args = [
        "--bind",
        "localhost:0",
        "--metrics",
        "localhost:0",
        "--pool",
        "64MiB",
    ];
    let line = serve_line(exe(), &args);
    let addr = tessera_storage::announced_addr(&line).expect("a listening line");
    assert!(addr.starts_with("127.0.0.1:"), "{line}");
    assert!(
        line.contains("engine shm") && line.contains("pool 64.00 MiB"),
        "{line}"
    );
    assert!(line.contains("metrics http://127.0.0.1:"), "{line}");
    // --quiet prints nothing: the unit serves without a word (it is stopped once it is seen
    // to answer).
    let mut child = exe()
        .args(["--quiet", "serve", "--bind", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    assert!(out.stdout.is_empty(), "{}", stdout(&out));
}

/// How many runtime workers `serve`, started by `cmd`, says it runs.
fn serve_workers(cmd: Command) -> usize {
    let line = serve_line(cmd, &["--bind", "127.0.0.1:0", "--pool", "64MiB"]);
    let (_, after) = line.split_once(", capacity ").expect(&line);
    let (_, workers) = after.split_once(", ").expect(&line);
    let (n, _) = workers.split_once(" worker(s)").expect(&line);
    n.parse().expect(&line)
}

/// Two workers, or one where the unit may run on one core only: two on one core took turns
/// at the scheduler's pace.
#[test]
fn serve_runs_one_worker_per_core_it_may_use_up_to_two() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_eq!(serve_workers(exe()), cores.min(2));
    let mut pinned = Command::new("taskset");
    pinned
        .args(["-c", "0", env!("CARGO_BIN_EXE_tessera-storage")])
        .env_remove("TESSERA_TOKEN")
        .env_remove("RUST_LOG");
    assert_eq!(serve_workers(pinned), 1);
}

#[test]
fn each_command_confirms_in_one_line_unless_quiet() {
    let unit = UnitProcess::start(Backend::Shm, &[]);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("in.bin");
    std::fs::write(&file, vec![7u8; 3000]).unwrap();
    let key = ["--partition", "p", "--index", "4", "--field", "f"];
    let with = |args: &[&str]| {
        let mut v = args.to_vec();
        v.extend(["--unit", &unit.addr]);
        v.extend(key);
        run(&v)
    };
    let o = with(&["put", "--file", file.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let said = stdout(&o);
    assert!(said.starts_with("stored p[4].f: 2.93 KiB in "), "{said}");
    assert_eq!(said.lines().count(), 1, "{said}");
    let out = dir.path().join("out.bin");
    let o = with(&["get", "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).starts_with(&format!("wrote p[4].f to {}: 2.93 KiB in ", out.display())),
        "{}",
        stdout(&o)
    );
    assert_eq!(std::fs::read(&out).unwrap(), vec![7u8; 3000]);
    // Without --out the value itself is printed, --quiet or not.
    let o = with(&["--quiet", "get"]);
    assert_eq!(stdout(&o), "bytes[3000]\n");
    let o = with(&["--quiet", "put", "--value", "x"]);
    assert!(o.status.success() && o.stdout.is_empty(), "{}", stdout(&o));
    let o = run(&[
        "clear",
        "--unit",
        &unit.addr,
        "--partition",
        "p",
        "--index",
        "4,5",
    ]);
    assert!(
        stdout(&o).starts_with("cleared 2 index(es) of partition p in "),
        "{}",
        stdout(&o)
    );
    let o = run(&["clear", "--unit", &unit.addr, "--partition", "p", "--all"]);
    assert!(
        stdout(&o).starts_with("dropped partition p in "),
        "{}",
        stdout(&o)
    );
    assert!(stderr(&o).is_empty(), "{}", stderr(&o));
}

#[test]
fn clear_needs_indexes_or_all() {
    let err = refused(&run(&["clear", "--partition", "p"]));
    assert!(err.contains("--index") && err.contains("--all"), "{err}");
    let err = refused(&run(&[
        "clear",
        "--partition",
        "p",
        "--index",
        "1",
        "--all",
    ]));
    assert!(err.contains("cannot be used with"), "{err}");
}

#[test]
fn an_error_is_said_once_with_its_address_and_without_a_backtrace() {
    let o = exe()
        .args(["stats", "--unit", "127.0.0.1:1"])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let err = failed(&o);
    assert!(err.contains("127.0.0.1:1"), "{err}");
    assert_eq!(err.matches("refused").count(), 1, "{err}");
    assert!(
        !err.contains("backtrace") && !err.contains("Caused by"),
        "{err}"
    );
    assert!(err.contains("hint:"), "{err}");
}

#[test]
fn errors_name_what_the_user_needs() {
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(&dir, "s3cret");
    let unit = UnitProcess::start(
        Backend::Shm,
        &["--token-file", &token, "--capacity", "1MiB"],
    );
    let base = ["--unit", unit.addr.as_str()];
    let put = |extra: &[&str]| {
        let mut v = vec!["put"];
        v.extend(base);
        v.extend(["--partition", "p", "--index", "1", "--field", "f"]);
        v.extend(extra);
        run(&v)
    };
    // No token given to a unit that needs one, a wrong one, the wrong backend.
    let err = failed(&put(&["--value", "x"]));
    assert!(
        err.contains("requires a token") && err.contains("--token-file"),
        "{err}"
    );
    let other = tempfile::tempdir().unwrap();
    let wrong = token_file(&other, "wrong");
    let err = failed(&put(&["--value", "x", "--token-file", &wrong]));
    assert!(err.contains("the tokens differ"), "{err}");
    let err = failed(&put(&[
        "--value",
        "x",
        "--token-file",
        &token,
        "--backend",
        "tcp",
    ]));
    assert!(
        err.contains("this unit uses the shm backend") && err.contains("--backend"),
        "{err}"
    );
    // A missing key is named; a PUT over capacity says what its bytes are.
    let mut get = vec!["get", "--token-file", &token];
    get.extend(base);
    get.extend(["--partition", "p", "--index", "9", "--field", "f"]);
    let err = failed(&run(&get));
    assert!(err.contains("index 9 field \"f\""), "{err}");
    let big = dir.path().join("big");
    std::fs::write(&big, vec![0u8; 2_000_000]).unwrap();
    let err = failed(&put(&[
        "--file",
        big.to_str().unwrap(),
        "--token-file",
        &token,
    ]));
    assert!(
        err.contains("2000000 of values") && err.contains("for its keys"),
        "{err}"
    );
    // A negative index is an index error, not an unknown flag.
    let err = refused(&run(&[
        "put",
        "--partition",
        "p",
        "--index",
        "-1",
        "--field",
        "f",
        "--value",
        "x",
    ]));
    assert!(err.contains("-1 is negative"), "{err}");
}

#[test]
fn sizes_durations_and_addresses_are_read_as_people_write_them() {
    let cfg = |args: &[&str]| {
        let mut v = vec!["serve", "--print-config"];
        v.extend(args);
        let o = run(&v);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    let text = cfg(&[
        "--capacity",
        "1G",
        "--pool",
        "4GiB",
        "--late-write-grace",
        "2s",
        "--metrics",
        "localhost:9470",
        "--bind",
        "localhost:7471",
    ]);
    assert!(text.contains("prefault_pool = false"), "{text}");
    assert!(text.contains("copy_slice_bytes = \"1MiB\""), "{text}");
    let prefaulted = cfg(&["--prefault-pool", "--copy-slice", "256KiB"]);
    assert!(prefaulted.contains("prefault_pool = true"), "{prefaulted}");
    assert!(
        prefaulted.contains("copy_slice_bytes = \"256KiB\""),
        "{prefaulted}"
    );
    assert!(text.contains("capacity_bytes = \"1GB\""), "{text}");
    assert!(text.contains("pool_bytes = \"4GiB\""), "{text}");
    assert!(text.contains("late_write_grace = \"2s\""), "{text}");
    assert!(text.contains("bind = \"127.0.0.1:7471\""), "{text}");
    // Every duration has its unit in the file: no bare seconds beside bare milliseconds.
    for key in ["handshake_timeout", "transfer_timeout", "prepare_ttl"] {
        let line = text.lines().find(|l| l.starts_with(key)).unwrap();
        let value = line.split_once(" = ").unwrap().1;
        assert!(
            value.starts_with('"') && value.trim_end_matches('"').ends_with(['s', 'm', 'h']),
            "{line}"
        );
    }
    // The file reads back, sizes and durations as strings.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("unit.toml");
    std::fs::write(
        &path,
        "pool_bytes = \"512MiB\"\n[unit]\ncapacity_bytes = \"2G\"\nprepare_ttl = \"1m\"\n",
    )
    .unwrap();
    let text = cfg(&["--config", path.to_str().unwrap()]);
    assert!(
        text.contains("pool_bytes = \"512MiB\"")
            && text.contains("capacity_bytes = \"2GB\"")
            && text.contains("prepare_ttl = \"1m\""),
        "{text}"
    );
    std::fs::write(&path, "[unit]\nprepare_ttl = 30000\n").unwrap();
    let o = run(&["serve", "--config", path.to_str().unwrap()]);
    assert!(
        failed(&o).contains("a duration takes a unit"),
        "{}",
        stderr(&o)
    );
    let err = refused(&run(&["serve", "--capacity", "lots"]));
    assert!(err.contains("KiB"), "{err}");
    let err = refused(&run(&["serve", "--late-write-grace", "300"]));
    assert!(err.contains("\"300ms\""), "{err}");
    // The token is never printed, but its presence is.
    let token = token_file(&dir, "s3cret");
    let text = cfg(&["--token-file", &token]);
    assert!(
        !text.contains("s3cret") && text.contains("token: set"),
        "{text}"
    );
}

#[test]
fn every_flag_says_what_it_is() {
    for cmd in ["serve", "put", "get", "clear", "stats"] {
        let o = run(&[cmd, "--help"]);
        assert!(o.status.success());
        let help = stdout(&o);
        let lines: Vec<&str> = help.lines().collect();
        let flags = lines
            .iter()
            .enumerate()
            .filter(|(_, l)| l.trim_start().starts_with('-'));
        for (i, line) in flags {
            // What a flag is follows it on its line, or on the lines under it.
            let beside = line
                .trim()
                .split_once("  ")
                .is_some_and(|(_, d)| !d.trim().is_empty());
            let under = lines
                .get(i + 1)
                .is_some_and(|d| !d.trim().is_empty() && !d.trim_start().starts_with('-'));
            let described = beside || under;
            assert!(described, "{cmd}: {line:?} has no description");
        }
    }
}

#[test]
fn stats_prints_a_table_or_json() {
    let unit = UnitProcess::start(Backend::Shm, &[]);
    let o = run(&[
        "put",
        "--unit",
        &unit.addr,
        "--partition",
        "p",
        "--index",
        "0",
        "--field",
        "f",
        "--value",
        "abc",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let table = stdout(&run(&["stats", "--unit", &unit.addr]));
    let mut lines = table.lines();
    assert!(lines.next().unwrap().starts_with("unit "), "{table}");
    assert!(lines.next().unwrap().starts_with("0 "), "{table}");
    assert!(table.contains("partition \"p\": 1 keys, 3 B"), "{table}");
    let json = stdout(&run(&["stats", "--json", "--unit", &unit.addr]));
    assert_eq!(json.lines().count(), 1, "{json}");
    let v: serde_json::Value = serde_json::from_str(json.trim()).unwrap();
    assert_eq!(v["keys"], 1);
    assert_eq!(v["partitions"][0]["name"], "p");
}

/// A binary built without the `etcd` feature refuses the cluster flags by name, and says how
/// to get them; the flags go together.
#[test]
#[cfg(not(feature = "etcd"))]
fn cluster_flags_need_an_etcd_build() {
    let err = failed(&run(&[
        "serve",
        "--bind",
        "127.0.0.1:0",
        "--etcd",
        "http://127.0.0.1:2379",
        "--cluster",
        "c",
    ]));
    assert!(
        err.contains("built without clusters") && err.contains("--features etcd"),
        "{err}"
    );
    let err = failed(&run(&[
        "stats",
        "--etcd",
        "http://127.0.0.1:2379",
        "--cluster",
        "c",
    ]));
    assert!(err.contains("built without clusters"), "{err}");
    let err = refused(&run(&["stats", "--cluster", "c"]));
    assert!(err.contains("--etcd"), "{err}");
    let err = refused(&run(&["serve", "--name", "u0"]));
    assert!(err.contains("--cluster"), "{err}");
}
