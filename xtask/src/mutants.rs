//! `cargo xtask mutants`: mutation testing of the code `mutants.toml` lists, with
//! [cargo-mutants](https://mutants.rs) installed under `.deps/cargo-mutants` (idempotently).
//!
//! Each group of the list is one cargo-mutants run over its package, with only the test
//! targets the group names. Groups run on two lanes side by side (`--lanes`), each lane with a
//! build dir of its own under `target/tessera-mutants/build-N`, kept between runs so that a
//! mutant rebuilds only what it touches; one `cargo xtask mutants` at a time. The list is checked against the mutants cargo-mutants generates
//! first: a listed function that yields no mutant (renamed, moved) or an `equivalent` entry that
//! matches none is an error, so the list cannot silently stop covering what it names.
//!
//! Results land in `target/tessera-mutants/`: each group's `mutants.out/` (cargo-mutants' own
//! logs and diffs), `files.json` (per file: caught, missed, timeout, unviable, equivalent),
//! `missed.txt` and `summary.json` (one flat object with the totals and `caught_ratio` =
//! caught / (caught + missed + timeout)).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use serde::Deserialize;

use crate::deps;

/// The cargo-mutants release xtask installs and runs.
const VERSION: &str = "27.1.0";

/// The list file, at the workspace root.
const LIST: &str = "mutants.toml";
/// `tessera_transport::testing::hang_guard` during runs, in seconds.
const HANG_GUARD_SECS: u64 = 15;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct List {
    group: Vec<Group>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Group {
    name: String,
    package: String,
    #[serde(default)]
    features: Vec<String>,
    /// `cargo test` arguments selecting the group's test targets (empty: all of the package).
    #[serde(default)]
    tests: Vec<String>,
    /// Whether the package needs the backends' libraries (`cargo xtask deps`) and test env.
    #[serde(default)]
    backend: bool,
    /// Seconds one mutant takes, build and tests, as measured: how lanes are planned until a
    /// run on this machine has timed the group (`target/tessera-mutants/timings.json`).
    #[serde(default)]
    secs_per_mutant: Option<f64>,
    file: Vec<FileEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileEntry {
    path: String,
    /// What the file guards, for the reader of the list.
    #[allow(dead_code)]
    guards: String,
    /// The functions to mutate; absent: the whole file.
    functions: Option<Vec<String>>,
    #[serde(default)]
    equivalent: Vec<Equivalent>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Equivalent {
    /// The mutant's name without its `file:line:col: ` prefix.
    mutant: String,
    /// Its line, where the name alone matches more than one mutant of the file.
    line: Option<u64>,
    #[allow(dead_code)]
    why: String,
}

impl Equivalent {
    /// Whether it names mutant `name` (`file:line:col: what`).
    fn matches(&self, name: &str) -> bool {
        let line = name.split(':').nth(1).and_then(|l| l.parse::<u64>().ok());
        strip_position(name) == self.mutant && self.line.is_none_or(|l| Some(l) == line)
    }
}

/// One generated mutant, as `cargo mutants --list --json` describes it.
#[derive(Deserialize)]
struct Listed {
    name: String,
    file: String,
}

#[derive(Default, Clone, Copy)]
struct Counts {
    caught: u64,
    missed: u64,
    timeout: u64,
    unviable: u64,
    equivalent: u64,
    /// Not run yet (`--report` after an interrupted run).
    untested: u64,
}

impl Counts {
    fn add(&mut self, o: &Counts) {
        self.caught += o.caught;
        self.missed += o.missed;
        self.timeout += o.timeout;
        self.unviable += o.unviable;
        self.equivalent += o.equivalent;
        self.untested += o.untested;
    }

    fn ratio(&self) -> f64 {
        let tested = self.caught + self.missed + self.timeout;
        if tested == 0 {
            return 1.0;
        }
        self.caught as f64 / tested as f64
    }
}

/// Runs the groups named in `only` (all when empty) on `lanes` lanes side by side; with
/// `list`, only checks the list and counts the mutants; with `iterate`, tests only what the
/// previous run of each group did not catch; with `report`, runs nothing and tallies the
/// groups' last results.
pub(crate) fn run(
    root: &Path,
    only: &[String],
    list: bool,
    lanes: usize,
    iterate: bool,
    report: bool,
) -> Result<()> {
    let text = fs::read_to_string(root.join(LIST)).with_context(|| format!("reading {LIST}"))?;
    let parsed: List = toml::from_str(&text).with_context(|| format!("parsing {LIST}"))?;
    for name in only {
        ensure!(
            parsed.group.iter().any(|g| &g.name == name),
            "{LIST} has no group {name:?}"
        );
    }
    let groups: Vec<&Group> = parsed
        .group
        .iter()
        .filter(|g| only.is_empty() || only.contains(&g.name))
        .collect();
    let tool = install(root)?;
    let out = root.join("target/tessera-mutants");
    fs::create_dir_all(&out)?;
    let layout = if groups.iter().any(|g| g.backend) {
        Some(deps::install(root).context("installing the backends' dependencies")?)
    } else {
        None
    };
    let mut files: BTreeMap<String, (String, Counts)> = BTreeMap::new();
    let mut sizes = Vec::new();
    // Each group's mutants as generated now, equivalent ones left out: what the counts cover.
    let mut current: Vec<Vec<String>> = Vec::new();
    for group in &groups {
        // Mutants in other functions that cargo-mutants lets through the function filter
        // (struct field deletions, which its name filters, `--exclude-re` included, do not
        // reach) still run, but are left out of the counts.
        let listed: Vec<Listed> = list_mutants(root, &tool, group, layout.as_ref())?
            .into_iter()
            .filter(|m| in_scope(group, m))
            .collect();
        check_list(group, &listed)?;
        current.push(
            listed
                .iter()
                .filter(|m| {
                    let entry = group.file.iter().find(|e| e.path == m.file);
                    !entry.is_some_and(|e| e.equivalent.iter().any(|q| q.matches(&m.name)))
                })
                .map(|m| m.name.clone())
                .collect(),
        );
        let mut total = 0;
        for entry in &group.file {
            let in_file = listed.iter().filter(|m| m.file == entry.path);
            let (eq, n) = in_file.fold((0u64, 0u64), |(eq, n), m| {
                match entry.equivalent.iter().any(|e| e.matches(&m.name)) {
                    true => (eq + 1, n),
                    false => (eq, n + 1),
                }
            });
            println!(
                "{:<18} {:<40} {n:>4} mutants, {eq} equivalent",
                group.name, entry.path
            );
            total += n;
            files.entry(entry.path.clone()).or_default().0 = group.name.clone();
            files.get_mut(&entry.path).expect("just added").1.equivalent += eq;
        }
        if iterate {
            // What is left to run: the mutants no earlier run caught or found unviable.
            let dir = out.join(&group.name).join("mutants.out");
            let done: std::collections::HashSet<String> = read_lists(&dir)?
                .into_iter()
                .filter(|(list, _)| !matches!(*list, "missed.txt" | "timeout.txt"))
                .map(|(_, name)| name)
                .collect();
            total = current.last().map_or(0, |names| {
                names.iter().filter(|n| !done.contains(*n)).count() as u64
            });
        }
        sizes.push(total);
    }
    if list {
        println!("{} mutants in all", sizes.iter().sum::<u64>());
        return Ok(());
    }
    let started = Instant::now();
    if !report {
        let runner = Runner {
            root,
            tool: &tool,
            layout: layout.as_ref(),
            out: &out,
            iterate,
        };
        run_lanes(&runner, &groups, &sizes, lanes)?;
    }
    let mut missed = Vec::new();
    for (group, names) in groups.iter().zip(&current) {
        let dir = out.join(&group.name).join("mutants.out");
        // With --iterate the lists also name mutants of lines since moved: only the mutants
        // generated now count, and one in no list was skipped as unviable before.
        let lists: BTreeMap<String, &str> = read_lists(&dir)?
            .into_iter()
            .map(|(list, name)| (name, list))
            .collect();
        for name in names {
            let file = name.split(':').next().unwrap_or_default().to_owned();
            let counts = &mut files.entry(file).or_default().1;
            match lists.get(name).copied() {
                Some("caught.txt" | "previously_caught.txt") => counts.caught += 1,
                Some("missed.txt") => {
                    counts.missed += 1;
                    missed.push(name.clone());
                }
                Some("timeout.txt") => {
                    counts.timeout += 1;
                    missed.push(format!("{name} (timeout)"));
                }
                Some(_) => counts.unviable += 1,
                None if iterate => counts.unviable += 1,
                None if report => counts.untested += 1,
                None => bail!("cargo-mutants reported no outcome for {name}"),
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let mut total = Counts::default();
    println!(
        "\n{:<44} {:>6} {:>6} {:>7} {:>8} {:>10} {:>8}",
        "file", "caught", "missed", "timeout", "unviable", "equivalent", "untested"
    );
    let mut rows = Vec::new();
    for (file, (group, c)) in &files {
        total.add(c);
        println!(
            "{file:<44} {:>6} {:>6} {:>7} {:>8} {:>10} {:>8}",
            c.caught, c.missed, c.timeout, c.unviable, c.equivalent, c.untested
        );
        rows.push(serde_json::json!({
            "file": file, "group": group, "caught": c.caught, "missed": c.missed,
            "timeout": c.timeout, "unviable": c.unviable, "equivalent": c.equivalent,
            "untested": c.untested,
        }));
    }
    println!(
        "{:<44} {:>6} {:>6} {:>7} {:>8} {:>10} {:>8}",
        "total",
        total.caught,
        total.missed,
        total.timeout,
        total.unviable,
        total.equivalent,
        total.untested
    );
    println!(
        "caught_ratio {:.4} in {:.0} s ({:.1} min)",
        total.ratio(),
        seconds,
        seconds / 60.0
    );
    let summary = serde_json::json!({
        "caught": total.caught,
        "missed": total.missed,
        "timeout": total.timeout,
        "unviable": total.unviable,
        "equivalent": total.equivalent,
        "untested": total.untested,
        "caught_ratio": total.ratio(),
        "seconds": seconds.round(),
        "groups": groups.iter().map(|g| g.name.as_str()).collect::<Vec<_>>().join(","),
    });
    fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    fs::write(out.join("files.json"), serde_json::to_string_pretty(&rows)?)?;
    fs::write(out.join("missed.txt"), missed.join("\n") + "\n")?;
    for m in &missed {
        println!("MISSED {m}");
    }
    println!("wrote {}", out.join("summary.json").display());
    Ok(())
}

/// What every group's run shares.
struct Runner<'a> {
    root: &'a Path,
    tool: &'a Path,
    layout: Option<&'a deps::Layout>,
    /// `target/tessera-mutants`.
    out: &'a Path,
    iterate: bool,
}

/// Seconds per mutant of a group that neither a run nor the list has timed.
const UNTIMED_SECS_PER_MUTANT: f64 = 10.0;

/// Seconds per mutant of each group, as the last runs measured them.
fn read_timings(out: &Path) -> BTreeMap<String, f64> {
    fs::read_to_string(out.join("timings.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default()
}

/// Records that `mutants` of `group` took `seconds`.
fn record_timing(out: &Path, group: &str, mutants: u64, seconds: f64) -> Result<()> {
    if mutants == 0 {
        return Ok(());
    }
    let mut timings = read_timings(out);
    timings.insert(group.to_owned(), seconds / mutants as f64);
    fs::write(
        out.join("timings.json"),
        serde_json::to_string_pretty(&timings)?,
    )?;
    Ok(())
}

/// Runs `groups` (of `sizes` mutants) on `lanes` lanes side by side.
fn run_lanes(r: &Runner<'_>, groups: &[&Group], sizes: &[u64], lanes: usize) -> Result<()> {
    // Lanes of groups run side by side, each with a build dir of its own: much of a mutant's
    // time is linking and tests that wait, which another lane overlaps. Groups are weighed by
    // the time their mutants took last time (a transport mutant takes ten times an
    // allocator's), and the heaviest are spread first.
    let lanes = lanes.max(1);
    let timings = read_timings(r.out);
    let weight = |i: usize| -> u64 {
        let per = timings
            .get(&groups[i].name)
            .copied()
            .or(groups[i].secs_per_mutant)
            .unwrap_or(UNTIMED_SECS_PER_MUTANT);
        (sizes[i] as f64 * per) as u64
    };
    let weights: Vec<u64> = (0..groups.len()).map(weight).collect();
    let plan = plan_lanes(&weights, lanes);
    let results: Vec<Result<()>> = std::thread::scope(|scope| {
        let handles: Vec<_> = plan
            .iter()
            .enumerate()
            .map(|(lane, (_, members))| {
                scope.spawn(move || -> Result<()> {
                    for &i in members {
                        run_group(r, groups[i], lane, sizes[i])?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| bail!("a lane panicked")))
            .collect()
    });
    results.into_iter().collect()
}

/// Groups of `weights` (seconds) spread over `lanes`: the heaviest first, each to the lane
/// with the least so far; each lane then runs its lightest group first, so that an
/// interrupted run has finished the most groups.
fn plan_lanes(weights: &[u64], lanes: usize) -> Vec<(u64, Vec<usize>)> {
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(weights[i]));
    let mut plan: Vec<(u64, Vec<usize>)> = vec![(0, Vec::new()); lanes.max(1)];
    for i in order {
        let lane = plan
            .iter_mut()
            .min_by_key(|(load, _)| *load)
            .expect("at least one lane");
        lane.0 += weights[i];
        lane.1.push(i);
    }
    for (_, members) in &mut plan {
        members.sort_by_key(|&i| weights[i]);
    }
    plan
}

/// One cargo-mutants run over `group` (`size` mutants to test) in lane `lane`'s build dir, its
/// output in `out/<group>.log`, its results in `out/<group>/mutants.out` and its time per
/// mutant in `out/timings.json`.
fn run_group(r: &Runner<'_>, group: &Group, lane: usize, size: u64) -> Result<()> {
    let Runner {
        root,
        tool,
        layout,
        out,
        iterate,
    } = *r;
    let group_out = out.join(&group.name);
    if !iterate {
        // A previous run's outcomes must not be read as this one's.
        let _ = fs::remove_dir_all(group_out.join("mutants.out"));
    }
    let log_path = out.join(format!("{}.log", group.name));
    let log = fs::File::create(&log_path)?;
    let started = Instant::now();
    let mut cmd = base_command(root, tool, group, layout, true);
    cmd.env("CARGO_TARGET_DIR", out.join(format!("build-{lane}")));
    cmd.arg("--output").arg(&group_out);
    if iterate {
        // Skips what the previous run caught or found unviable, and carries it over.
        cmd.arg("--iterate");
    }
    cmd.args(["--jobs", "1", "--cap-lints", "true"]);
    cmd.args(["--timeout-multiplier", "3", "--minimum-test-timeout", "30"]);
    cmd.args(["--build-timeout-multiplier", "4"]);
    if !group.tests.is_empty() {
        cmd.arg("--");
        cmd.args(&group.tests);
        // Each test binary stops at its first failing test (libtest's `--fail-fast`, an
        // unstable option that `RUSTC_BOOTSTRAP` in the binary's own environment allows; the
        // build never sees it): one failure decides a mutant, and a test still waiting on a
        // transfer the mutant hung no longer holds the binary until the time limit. Only for
        // groups that name their test targets, since doctests run under rustdoc.
        if !group.tests.iter().any(|a| a == "--") {
            cmd.arg("--");
        }
        cmd.args(["-Zunstable-options", "--fail-fast"]);
        cmd.env(runner_var()?, "env RUSTC_BOOTSTRAP=1");
    }
    println!(
        "==> lane {lane}: group {} (log: {})",
        group.name,
        log_path.display()
    );
    let status = cmd
        .stdout(log.try_clone()?)
        .stderr(log)
        .status()
        .context("starting cargo-mutants")?;
    // 0: all caught; 2: some missed; 3: some timed out. Anything else is no result (a
    // failing baseline, a bad argument): the log says why.
    if !matches!(status.code(), Some(0 | 2 | 3)) {
        bail!(
            "cargo-mutants failed on group {} ({status}); see {}",
            group.name,
            log_path.display()
        );
    }
    let seconds = started.elapsed().as_secs_f64();
    println!("==> lane {lane}: group {} took {seconds:.0} s", group.name);
    record_timing(out, &group.name, size, seconds)
}

/// The cargo-mutants binary under `.deps/cargo-mutants`, installed there unless that exact
/// version already is.
fn install(root: &Path) -> Result<PathBuf> {
    let prefix = root.join(".deps/cargo-mutants");
    let bin = prefix.join("bin/cargo-mutants");
    let installed = Command::new(&bin)
        .args(["mutants", "--version"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(VERSION));
    if !installed {
        println!(
            "==> installing cargo-mutants {VERSION} into {}",
            prefix.display()
        );
        let status = crate::cargo(&["install", "--locked", "cargo-mutants", "--version", VERSION])
            .arg("--root")
            .arg(&prefix)
            .status()
            .context("starting cargo install")?;
        ensure!(
            status.success(),
            "cargo install cargo-mutants failed ({status})"
        );
    }
    Ok(bin)
}

/// `cargo mutants` over `group`'s files and functions, in a target dir of its own (kept
/// between runs, so only what a mutant touches rebuilds) and without debug info (faster links).
fn base_command(
    root: &Path,
    tool: &Path,
    group: &Group,
    layout: Option<&deps::Layout>,
    exclusions: bool,
) -> Command {
    let mut cmd = Command::new(tool);
    cmd.arg("mutants").arg("--no-config").arg("--dir").arg(root);
    cmd.args(["--package", &group.package]);
    if !group.features.is_empty() {
        cmd.args(["--features", &group.features.join(",")]);
    }
    for entry in &group.file {
        cmd.args(["--file", &entry.path]);
        for eq in entry.equivalent.iter().filter(|_| exclusions) {
            let line = eq
                .line
                .map_or_else(|| "[0-9]+".to_owned(), |l| l.to_string());
            cmd.arg("--exclude-re").arg(format!(
                "^{}:{line}:[0-9]+: {}$",
                escape(&entry.path),
                escape(&eq.mutant)
            ));
        }
    }
    cmd.arg("--re").arg(examine_re(group));
    // Lane 0's build dir; `run_group` names its lane's.
    cmd.env(
        "CARGO_TARGET_DIR",
        root.join("target/tessera-mutants/build-0"),
    )
    .env("CARGO_PROFILE_DEV_DEBUG", "0")
    .env("CARGO_TERM_COLOR", "never")
    // A caught mutant fails at once: no shrinking, and no regression file written into
    // the source tree for a failure that only the mutant causes.
    .env("PROPTEST_MAX_SHRINK_ITERS", "0")
    .env("PROPTEST_DISABLE_FAILURE_PERSISTENCE", "1")
    // A mutant that hangs transfers fails the tests that wait for them well within their
    // time limit (at least 30 s), rather than timing out: a catch, not a timeout.
    .env("TESSERA_TEST_HANG_GUARD_SECS", HANG_GUARD_SECS.to_string());
    if let Some(layout) = layout.filter(|_| group.backend) {
        cmd.env("TESSERA_UCX_DIR", layout.ucx_dir())
            .env("TESSERA_NIXL_LIB_DIR", layout.nixl_lib_dir());
        cmd.envs(deps::TEST_ENV.iter().copied());
    }
    cmd
}

/// `CARGO_TARGET_<HOST>_RUNNER`: the variable that wraps the host's test binaries when cargo
/// runs them.
fn runner_var() -> Result<String> {
    let out = Command::new("rustc")
        .arg("-vV")
        .output()
        .context("running rustc -vV")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let host = text
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .context("rustc -vV names no host")?;
    Ok(format!(
        "CARGO_TARGET_{}_RUNNER",
        host.to_uppercase().replace(['-', '.'], "_")
    ))
}

/// The mutants of `group` as cargo-mutants generates them (no build, no test), equivalent ones
/// included.
fn list_mutants(
    root: &Path,
    tool: &Path,
    group: &Group,
    layout: Option<&deps::Layout>,
) -> Result<Vec<Listed>> {
    let mut cmd = base_command(root, tool, group, layout, false);
    cmd.args(["--list", "--json"]);
    let out = cmd.output().context("starting cargo-mutants --list")?;
    ensure!(
        out.status.success(),
        "cargo mutants --list failed for group {}: {}",
        group.name,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).context("parsing cargo mutants --list --json")
}

/// Whether `m` is in one of the functions its file's entry lists (or the entry lists none).
fn in_scope(group: &Group, m: &Listed) -> bool {
    group
        .file
        .iter()
        .find(|e| e.path == m.file)
        .is_some_and(|e| match &e.functions {
            None => true,
            Some(fs) => fs.iter().any(|f| names_function(&m.name, f)),
        })
}

/// Every listed file and function yields a mutant, and every equivalent entry is one of them.
fn check_list(group: &Group, listed: &[Listed]) -> Result<()> {
    for entry in &group.file {
        let in_file: Vec<&str> = listed
            .iter()
            .filter(|m| m.file == entry.path)
            .map(|m| m.name.as_str())
            .collect();
        ensure!(
            !in_file.is_empty() || entry.functions.is_none(),
            "{LIST}: {} yields no mutant (moved or renamed?)",
            entry.path
        );
        for f in entry.functions.iter().flatten() {
            ensure!(
                in_file.iter().any(|name| names_function(name, f)),
                "{LIST}: {}: no mutant of {f} (renamed, moved, or nothing to mutate?)",
                entry.path
            );
        }
        for eq in &entry.equivalent {
            let matching = in_file.iter().filter(|name| eq.matches(name)).count();
            ensure!(
                matching > 0,
                "{LIST}: {}: equivalent mutant {:?} is not generated (changed or gone?)",
                entry.path,
                eq.mutant
            );
            ensure!(
                matching == 1,
                "{LIST}: {}: equivalent mutant {:?} names {matching} mutants: give its line",
                entry.path,
                eq.mutant
            );
        }
    }
    Ok(())
}

/// The name without its `file:line:col: ` prefix.
fn strip_position(name: &str) -> &str {
    name.split_once(": ").map_or(name, |(_, rest)| rest)
}

/// Whether mutant `name` mutates function `f` (or a function nested in it).
fn names_function(name: &str, f: &str) -> bool {
    let what = strip_position(name);
    let nested = |rest: &str| rest.is_empty() || rest.starts_with("::");
    if let Some(rest) = what
        .strip_prefix("replace ")
        .and_then(|r| r.strip_prefix(f))
    {
        let rest = rest.split(' ').next().unwrap_or("");
        if nested(rest) {
            return true;
        }
    }
    what.rsplit_once(" in ")
        .and_then(|(_, func)| func.strip_prefix(f))
        .is_some_and(nested)
}

/// The `--re` filter of `group`: whole files, or the listed functions of a file.
fn examine_re(group: &Group) -> String {
    let alts: Vec<String> = group
        .file
        .iter()
        .map(|entry| {
            let file = escape(&entry.path);
            match &entry.functions {
                None => format!("^{file}:"),
                Some(fs) => {
                    let fs = fs.iter().map(|f| escape(f)).collect::<Vec<_>>().join("|");
                    let f = format!("(?:{fs})(?:::[A-Za-z0-9_]+)*");
                    format!("^{file}:[0-9]+:[0-9]+: (?:replace {f} (?:->|with) |.* in {f}$)")
                }
            }
        })
        .collect();
    alts.join("|")
}

/// `s` with the regex metacharacters escaped.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Each mutant of a `mutants.out` with the list that names it: cargo-mutants' `caught.txt`,
/// `missed.txt`, `timeout.txt`, `unviable.txt`, and with `--iterate` the `previously_caught.txt`
/// of the mutants an earlier run caught and this one skipped. Lists not there are empty.
fn read_lists(dir: &Path) -> Result<Vec<(&'static str, String)>> {
    let mut out = Vec::new();
    for list in [
        "caught.txt",
        "previously_caught.txt",
        "missed.txt",
        "timeout.txt",
        "unviable.txt",
    ] {
        let path = dir.join(list);
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            // Missing: an earlier run's list (--iterate), or a group never run (--report);
            // a mutant named in no list is reported as such by the caller.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        let mut names: Vec<String> = text.lines().map(str::to_owned).collect();
        names.sort();
        names.dedup();
        out.extend(names.into_iter().map(|n| (list, n)));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn function_names_match_their_mutants_only() {
        let n = "a/b.rs:10:5: replace Registry::pin_spans -> Result<(), E> with Ok(())";
        assert!(names_function(n, "Registry::pin_spans"));
        assert!(!names_function(n, "Registry::pin"));
        let n = "a/b.rs:10:5: replace < with <= in Registry::pin_spans";
        assert!(names_function(n, "Registry::pin_spans"));
        assert!(!names_function(n, "Registry::pin"));
        let n = "a/b.rs:3:1: replace == with != in read_small::exact";
        assert!(names_function(n, "read_small"));
        let n = "a/b.rs:3:1: replace check with ()";
        assert!(names_function(n, "check"));
        assert_eq!(strip_position(n), "replace check with ()");
    }

    #[test]
    fn escaping_keeps_names_literal() {
        assert_eq!(escape("Unit<M>::put"), "Unit<M>::put");
        assert_eq!(escape("a.rs"), "a\\.rs");
        assert_eq!(escape("State<'_, '_>::f()"), "State<'_, '_>::f\\(\\)");
    }

    /// The two heaviest groups run side by side, and the light ones fill the lighter lane,
    /// each lane lightest first.
    #[test]
    fn lanes_are_balanced_by_time_not_count() {
        // transport, transport-engines, storage, alloc, nixl (seconds).
        let plan = plan_lanes(&[3000, 2900, 1800, 300, 250], 2);
        assert_eq!(plan[0], (3550, vec![4, 3, 0]));
        assert_eq!(plan[1], (4700, vec![2, 1]));
        let one = plan_lanes(&[5, 1], 0);
        assert_eq!(one, vec![(6, vec![1, 0])]);
    }
}
