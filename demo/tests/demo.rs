//! The README's first command, `cargo xtask demo`, in its short form: the real binary, the
//! real child processes, the real summary.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

const DEMO: &str = env!("CARGO_BIN_EXE_tessera-demo");

/// Kills the demo if a test fails while it runs.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn run(args: &[&str]) -> (Output, String, String) {
    let out = Command::new(DEMO)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("the demo starts");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stdout, stderr)
}

/// The pids the orchestrator printed for its children.
fn child_pids(stdout: &str) -> Vec<(String, u32)> {
    stdout
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let role = words.next()?;
            (words.next()? == "pid").then_some(())?;
            Some((role.to_owned(), words.next()?.parse().ok()?))
        })
        .collect()
}

fn check_short_summary(backend: &str) {
    let (out, stdout, stderr) = run(&["run", "--short", "--backend", backend]);
    assert!(
        out.status.success(),
        "the demo failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let roles: Vec<String> = child_pids(&stdout).into_iter().map(|(r, _)| r).collect();
    assert_eq!(roles, ["unit", "consumer", "producer"], "{stdout}");
    for expected in [
        &format!("Summary · backend {backend}"),
        "checksums (CRC32): 768/768 rollouts, 600/600 weight tensors",
        "after the run: 0 keys, 0 B used in the unit's pool; storage unit shut down in order",
        "GET results: 3072/3072 tensors are views",
        "600/600 tensors are views of the receive pool",
        "PUT (16 rollouts)",
        "GET (16 rollouts)",
        "rollout PUT against the machine: ",
        "\n  errors: 0\n",
    ] {
        assert!(
            stdout.contains(expected),
            "missing {expected:?} in:\n{stdout}\n{stderr}"
        );
    }
    assert!(!stdout.contains("error: "), "{stdout}");
    // Who copies a PUT's payload depends on the engine: the unit pulls over ucx and nixl.
    let put_copy = match backend {
        "ucx" | "nixl" => "the unit's READ of the client's frames",
        _ => "the client's WRITE into the unit's block",
    };
    assert!(stdout.contains(put_copy), "{put_copy:?} in:\n{stdout}");
    // The unit's peak is sampled as the roles report progress: a run shorter than the
    // 100 ms tick still shows what the unit held.
    let row = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("storage unit"))
        .unwrap_or_else(|| panic!("no unit row in:\n{stdout}"));
    let columns: Vec<&str> = row
        .split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    assert!(
        columns.len() == 4 && !columns[2].starts_with("0 B "),
        "the unit's peak in {row:?}"
    );
}

#[test]
fn the_short_demo_passes_every_check_over_shm() {
    check_short_summary("shm");
}

#[test]
fn the_short_demo_passes_every_check_over_tcp() {
    check_short_summary("tcp");
}

/// Run by `cargo xtask test` in the `ucx` feature run (`-- over_ucx`).
#[cfg(feature = "ucx")]
#[test]
fn the_short_demo_passes_every_check_over_ucx() {
    check_short_summary("ucx");
}

/// Run by `cargo xtask test` in the `nixl` feature run (`-- over_nixl`).
#[cfg(feature = "nixl")]
#[test]
fn the_short_demo_passes_every_check_over_nixl() {
    check_short_summary("nixl");
}

/// Without their features, `ucx` and `nixl` are refused before anything starts, naming the
/// feature and the command that builds with it.
#[test]
fn a_backend_this_build_lacks_is_refused_before_anything_starts() {
    let lacking = [
        ("ucx", cfg!(feature = "ucx")),
        ("nixl", cfg!(feature = "nixl")),
    ];
    for (backend, _) in lacking.iter().filter(|(_, built)| !built) {
        let (out, stdout, stderr) = run(&["run", "--short", "--backend", backend]);
        assert!(!out.status.success(), "{stdout}");
        assert!(child_pids(&stdout).is_empty(), "{stdout}");
        assert!(
            stderr.contains(&format!("backend `{backend}` is not available"))
                && stderr.contains(&format!("cargo feature `{backend}`"))
                && stderr.contains(&format!("cargo xtask demo --backend {backend}"))
                && stderr.contains("there is no fallback"),
            "{stderr}"
        );
    }
}

#[test]
fn ctrl_c_stops_every_child_and_exits_non_zero() {
    let child = Command::new(DEMO)
        .args(["run", "--short", "--stall"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the demo starts");
    let mut demo = Guard(child);
    let mut lines = BufReader::new(demo.0.stdout.take().expect("piped"));
    let mut seen = String::new();
    loop {
        let mut l = String::new();
        let n = lines.read_line(&mut l).expect("reading the demo's stdout");
        assert!(n > 0, "the demo ended before stalling:\n{seen}");
        seen.push_str(&l);
        if l.contains("stalled after its first step") {
            break;
        }
    }
    let pids = child_pids(&seen);
    assert_eq!(pids.len(), 3, "{seen}");
    for (role, pid) in &pids {
        assert!(Path::new(&format!("/proc/{pid}")).exists(), "{role} runs");
    }

    let sent = Command::new("kill")
        .args(["-INT", &demo.0.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(sent.success());
    let status = demo.0.wait().expect("the demo exits");
    let mut stderr = String::new();
    demo.0
        .stderr
        .take()
        .expect("piped")
        .read_to_string(&mut stderr)
        .expect("reading stderr");
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted (Ctrl-C): stopped"), "{stderr}");
    for (role, pid) in &pids {
        assert!(stderr.contains(&format!("{role} (pid {pid})")), "{stderr}");
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "{role} (pid {pid}) outlived the demo"
        );
    }
}
