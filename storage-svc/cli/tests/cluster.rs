//! Units of a cluster as separate `tessera-storage serve` processes, announced in a private
//! etcd, and the client commands that find them by the cluster's name: a unit killed with
//! SIGKILL costs no value that has a replica and leaves the set within its lease's TTL, one
//! stopped with SIGTERM withdraws at once.

mod common;

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::UnitProcess;
use tessera_cluster::testing::Etcd;
use tessera_storage::Backend;

const WAIT: Duration = Duration::from_secs(30);

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera-storage"))
        .env_remove("TESSERA_TOKEN")
        .env_remove("RUST_LOG")
        .args(args)
        .output()
        .expect("run tessera-storage")
}

fn ok(o: &Output) -> String {
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "stdout: {out}\nstderr: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

struct Cluster {
    etcd: Etcd,
}

impl Cluster {
    fn unit(&self, name: &str) -> UnitProcess {
        let url = self.etcd.url();
        UnitProcess::start(
            Backend::Shm,
            &[
                "--etcd",
                &url,
                "--cluster",
                "c",
                "--name",
                name,
                "--lease-ttl",
                "2s",
            ],
        )
    }

    /// `cmd` of the client commands, reaching the cluster's units with two replicas.
    fn client(&self, cmd: &str, rest: &[&str]) -> Output {
        let url = self.etcd.url();
        let mut args = vec![cmd, "--etcd", &url, "--cluster", "c", "--replicas", "2"];
        args.extend(rest);
        run(&args)
    }

    /// The unit names `stats` lists, waiting until they are `names`.
    fn until_units(&self, names: &str) -> Duration {
        let t = Instant::now();
        loop {
            let out = ok(&self.client("stats", &[]));
            let line = out.lines().next().unwrap_or_default().to_owned();
            if line.ends_with(&format!(": {names}")) {
                return t.elapsed();
            }
            assert!(
                t.elapsed() < WAIT,
                "stats says {line:?}, waiting for {names}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn put(c: &Cluster, index: u64) {
    let value = format!("value {index}");
    ok(&c.client(
        "put",
        &[
            "--partition",
            "p",
            "--index",
            &index.to_string(),
            "--field",
            "f",
            "--value",
            &value,
        ],
    ));
}

fn get(c: &Cluster, index: u64) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out");
    let path = path.to_str().unwrap();
    ok(&c.client(
        "get",
        &[
            "--partition",
            "p",
            "--index",
            &index.to_string(),
            "--field",
            "f",
            "--out",
            path,
        ],
    ));
    String::from_utf8(std::fs::read(path).unwrap()).unwrap()
}

#[test]
fn units_announced_in_etcd_serve_clients_that_name_the_cluster() {
    let c = Cluster {
        etcd: Etcd::start().unwrap(),
    };
    let _u0 = c.unit("u0");
    let mut u1 = c.unit("u1");
    let mut u2 = c.unit("u2");
    c.until_units("u0, u1, u2");
    for i in 0..12 {
        put(&c, i);
    }
    let stats = ok(&c.client("stats", &[]));
    assert!(
        stats.starts_with("3 unit(s) as of etcd revision "),
        "{stats}"
    );
    // Killed: every value still reads back from its other replica, and the unit is gone from
    // the set within twice its lease.
    let killed = Instant::now();
    u1.kill();
    for i in 0..12 {
        assert_eq!(get(&c, i), format!("value {i}"));
    }
    c.until_units("u0, u2");
    assert!(
        killed.elapsed() < Duration::from_secs(4),
        "{:?}",
        killed.elapsed()
    );
    // Stopped in order: withdrawn before it stops answering, so gone at once.
    let pid = u2.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    assert!(u2.child.wait().unwrap().success());
    let left = c.until_units("u0");
    assert!(left < Duration::from_secs(2), "withdrawn after {left:?}");
    // Too few units for two copies: a PUT says so.
    let o = c.client(
        "put",
        &[
            "--partition",
            "p",
            "--index",
            "99",
            "--field",
            "f",
            "--value",
            "x",
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("only 1 live unit(s) of the cluster, and 2 needed"),
        "{err}"
    );
    // Modulo placement is refused for a cluster.
    let o = c.client("stats", &["--placement", "modulo"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("needs a fixed --unit list"));
}
