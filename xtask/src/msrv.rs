//! Every package's `rust-version` must be true: at least the `rust-version` of every crate it
//! builds with (normal and build dependencies, on this platform, as the lock file resolves
//! them). Tests may need a newer toolchain (their dev-dependencies); the README says which.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

#[derive(Deserialize)]
struct Metadata {
    packages: Vec<Package>,
    workspace_members: Vec<String>,
    resolve: Resolve,
}

#[derive(Deserialize)]
struct Package {
    id: String,
    name: String,
    rust_version: Option<String>,
}

#[derive(Deserialize)]
struct Resolve {
    nodes: Vec<Node>,
}

#[derive(Deserialize)]
struct Node {
    id: String,
    deps: Vec<Dep>,
}

#[derive(Deserialize)]
struct Dep {
    pkg: String,
    dep_kinds: Vec<DepKind>,
}

#[derive(Deserialize)]
struct DepKind {
    kind: Option<String>,
}

/// `1.85` and `1.85.0` alike, as `[1, 85, 0]`.
fn parse(v: &str) -> [u64; 3] {
    let mut out = [0; 3];
    for (slot, part) in out.iter_mut().zip(v.split('.')) {
        *slot = part.parse().unwrap_or(0);
    }
    out
}

/// Packages whose declared `rust-version` is older than what a dependency needs, as messages.
fn untrue(meta: &Metadata) -> Vec<String> {
    let packages: HashMap<&str, &Package> =
        meta.packages.iter().map(|p| (p.id.as_str(), p)).collect();
    let nodes: HashMap<&str, &Node> = meta
        .resolve
        .nodes
        .iter()
        .map(|n| (n.id.as_str(), n))
        .collect();
    let mut out = Vec::new();
    for member in &meta.workspace_members {
        let Some(pkg) = packages.get(member.as_str()) else {
            continue;
        };
        let declared = pkg.rust_version.as_deref().map(parse).unwrap_or_default();
        let mut seen = HashSet::new();
        let mut stack = vec![member.as_str()];
        while let Some(id) = stack.pop() {
            if !seen.insert(id) {
                continue;
            }
            let Some(node) = nodes.get(id) else { continue };
            for d in &node.deps {
                let builds_with = d.dep_kinds.iter().any(|k| k.kind.as_deref() != Some("dev"));
                if builds_with {
                    stack.push(d.pkg.as_str());
                }
            }
        }
        for id in seen {
            let Some(dep) = packages.get(id) else {
                continue;
            };
            if let Some(need) = dep.rust_version.as_deref() {
                if parse(need) > declared {
                    out.push(format!(
                        "{} declares rust-version {} but builds with {} {}, which needs {need}",
                        pkg.name,
                        pkg.rust_version.as_deref().unwrap_or("(none)"),
                        dep.name,
                        id.rsplit(['#', '@']).next().unwrap_or("")
                    ));
                }
            }
        }
    }
    out.sort();
    out
}

/// Fails when a package's `rust-version` is older than one of its dependencies needs.
pub(crate) fn check(root: &Path) -> Result<()> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["metadata", "--format-version", "1", "--locked"])
        .args(["--filter-platform", "x86_64-unknown-linux-gnu"])
        .current_dir(root)
        .output()
        .context("running cargo metadata")?;
    if !out.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let meta: Metadata =
        serde_json::from_slice(&out.stdout).context("reading cargo metadata's output")?;
    let wrong = untrue(&meta);
    if !wrong.is_empty() {
        bail!("rust-version is not true:\n  {}", wrong.join("\n  "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(json: &str) -> Metadata {
        serde_json::from_str(json).unwrap()
    }

    /// A normal dependency newer than the declared version is reported; a dev-dependency is not.
    #[test]
    fn only_what_a_package_builds_with_counts() {
        let m = meta(
            r#"{
              "workspace_members": ["a"],
              "packages": [
                {"id": "a", "name": "a", "rust_version": "1.85"},
                {"id": "b", "name": "b", "rust_version": "1.88"},
                {"id": "c", "name": "c", "rust_version": "1.95"},
                {"id": "d", "name": "d", "rust_version": "1.85.0"}
              ],
              "resolve": {"nodes": [
                {"id": "a", "deps": [
                  {"pkg": "b", "dep_kinds": [{"kind": null}]},
                  {"pkg": "c", "dep_kinds": [{"kind": "dev"}]}
                ]},
                {"id": "b", "deps": [{"pkg": "d", "dep_kinds": [{"kind": "build"}]}]},
                {"id": "c", "deps": []},
                {"id": "d", "deps": []}
              ]}
            }"#,
        );
        let wrong = untrue(&m);
        assert_eq!(wrong.len(), 1, "{wrong:?}");
        assert!(wrong[0].starts_with("a declares rust-version 1.85 but builds with b"));
    }
}
