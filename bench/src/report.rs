//! One suite's results: a printed table and a flat JSON object of metric name to number.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Metrics of one suite, in the order they were recorded, each with how it was taken.
#[derive(Debug, Default)]
pub struct Report {
    suite: String,
    rows: Vec<(String, f64, String)>,
}

impl Report {
    /// An empty report for `suite`.
    pub fn new(suite: &str) -> Self {
        Self {
            suite: suite.to_owned(),
            rows: Vec::new(),
        }
    }

    /// Records `key = value`; `how` says in a few words how the figure was taken.
    pub fn put(&mut self, key: &str, value: f64, how: impl Into<String>) {
        self.rows.push((key.to_owned(), value, how.into()));
    }

    /// The value recorded under `key`.
    pub fn get(&self, key: &str) -> Option<f64> {
        self.rows.iter().find(|r| r.0 == key).map(|r| r.1)
    }

    /// The table, as Markdown.
    pub fn table(&self) -> String {
        let mut out = format!(
            "### {}\n\n| metric | value | how it was taken |\n|---|---:|---|\n",
            self.suite
        );
        for (key, value, how) in &self.rows {
            out.push_str(&format!("| `{key}` | {} | {how} |\n", fmt_value(*value)));
        }
        out
    }

    /// Writes `<dir>/<suite>.json` and returns its path.
    pub fn write_json(&self, dir: &Path) -> Result<PathBuf> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let map: BTreeMap<&str, f64> = self.rows.iter().map(|(k, v, _)| (k.as_str(), *v)).collect();
        let path = dir.join(format!("{}.json", self.suite));
        std::fs::write(&path, serde_json::to_string_pretty(&map)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }
}

fn fmt_value(v: f64) -> String {
    if v == 0.0 || (v.abs() >= 0.01 && v.abs() < 1e7) {
        format!("{v:.3}")
    } else {
        format!("{v:.3e}")
    }
}
