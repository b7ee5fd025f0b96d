//! One suite's results: a printed table, a flat JSON object of metric name to number, and the
//! series its plots are drawn from.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Serialize;

/// Metrics of one suite, in the order they were recorded, each with how it was taken.
#[derive(Debug, Default)]
pub struct Report {
    suite: String,
    rows: Vec<(String, f64, String)>,
    series: Vec<Series>,
}

/// A figure: one or more lines of (x, y) points sharing axes.
#[derive(Debug, Clone, Serialize)]
pub struct Series {
    /// File stem of the plot, unique within the suite.
    pub name: String,
    /// Title drawn above the plot.
    pub title: String,
    /// Label of the x axis.
    pub x_label: String,
    /// Label of the y axis.
    pub y_label: String,
    /// Whether the x axis is logarithmic (payload sizes).
    pub log_x: bool,
    /// The lines, each with its legend label.
    pub lines: Vec<Line>,
}

/// One line of a [`Series`].
#[derive(Debug, Clone, Serialize)]
pub struct Line {
    /// Legend label.
    pub label: String,
    /// Points, in x order.
    pub points: Vec<(f64, f64)>,
}

impl Report {
    /// An empty report for `suite`.
    pub fn new(suite: &str) -> Self {
        Self {
            suite: suite.to_owned(),
            ..Self::default()
        }
    }

    /// The suite's name.
    pub fn suite(&self) -> &str {
        &self.suite
    }

    /// Records `key = value`; `how` says in a few words how the figure was taken.
    pub fn put(&mut self, key: &str, value: f64, how: impl Into<String>) {
        self.rows.push((key.to_owned(), value, how.into()));
    }

    /// The value recorded under `key`.
    pub fn get(&self, key: &str) -> Option<f64> {
        self.rows.iter().find(|r| r.0 == key).map(|r| r.1)
    }

    /// Records a figure to plot.
    pub fn series(&mut self, series: Series) {
        self.series.push(series);
    }

    /// The figures recorded so far.
    pub fn all_series(&self) -> &[Series] {
        &self.series
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

    /// Writes `<dir>/<suite>.json` (the flat metrics), `<dir>/<suite>.md` (the table) and, when
    /// the suite recorded figures, `<dir>/<suite>.series.json`. Returns the JSON's path.
    pub fn write_json(&self, dir: &Path) -> Result<PathBuf> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let map: BTreeMap<&str, f64> = self.rows.iter().map(|(k, v, _)| (k.as_str(), *v)).collect();
        let path = dir.join(format!("{}.json", self.suite));
        write(&path, serde_json::to_string_pretty(&map)? + "\n")?;
        write(&dir.join(format!("{}.md", self.suite)), self.table())?;
        if !self.series.is_empty() {
            let series = dir.join(format!("{}.series.json", self.suite));
            write(&series, serde_json::to_string(&self.series)? + "\n")?;
        }
        Ok(path)
    }
}

fn write(path: &Path, text: String) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn fmt_value(v: f64) -> String {
    if v == 0.0 || (v.abs() >= 0.01 && v.abs() < 1e7) {
        format!("{v:.3}")
    } else {
        format!("{v:.3e}")
    }
}
