//! Draws a suite's figures as SVG and PNG with plotters.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Result};
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::report::Series;

const SIZE: (u32, u32) = (900, 540);

/// Draws every figure of `suite` into `dir` as `<suite>-<name>.svg` and `.png`; returns the
/// PNG paths.
pub fn draw_all(suite: &str, series: &[Series], dir: &Path) -> Result<Vec<PathBuf>> {
    let mut pngs = Vec::new();
    for s in series {
        let stem = dir.join(format!("{suite}-{}", s.name));
        let svg = stem.with_extension("svg");
        draw(s, SVGBackend::new(&svg, SIZE).into_drawing_area())?;
        let png = stem.with_extension("png");
        draw(s, BitMapBackend::new(&png, SIZE).into_drawing_area())?;
        pngs.push(png);
    }
    Ok(pngs)
}

fn draw<DB: DrawingBackend>(s: &Series, area: DrawingArea<DB, Shift>) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("drawing {}: {e:?}", s.name);
    area.fill(&WHITE).map_err(err)?;
    let points = s.lines.iter().flat_map(|l| l.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, 0f64);
    for &(x, y) in points {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1) = (1.0, 2.0);
    }
    if x0 == x1 {
        x1 = x0 + 1.0;
    }
    // Zoom in on values that all sit well above zero (ratios near 1); otherwise start at 0.
    let y0 = if y0 > 0.3 * y1 && y1 > y0 {
        (y0 - (y1 - y0) * 0.25).max(0.0)
    } else {
        0.0
    };
    let y1 = if y1 > 0.0 { y1 + (y1 - y0) * 0.1 } else { 1.0 };
    let mut builder = ChartBuilder::on(&area);
    builder
        .caption(&s.title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64);
    macro_rules! body {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(s.x_label.as_str())
                .y_desc(s.y_label.as_str())
                .x_label_formatter(&|x| if s.log_x { bytes(*x) } else { format!("{x}") })
                .draw()
                .map_err(err)?;
            for (i, line) in s.lines.iter().enumerate() {
                let color = Palette99::pick(i).to_rgba();
                chart
                    .draw_series(LineSeries::new(
                        line.points.iter().copied(),
                        color.stroke_width(1),
                    ))
                    .map_err(err)?
                    .label(line.label.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new([(x, y), (x + 18, y)], color.stroke_width(1))
                    });
                if line.points.len() <= 64 {
                    let dots = line
                        .points
                        .iter()
                        .map(|&p| Circle::new(p, 3, color.filled()));
                    chart.draw_series(dots).map_err(err)?;
                }
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .position(if s.log_x {
                    SeriesLabelPosition::UpperRight
                } else {
                    SeriesLabelPosition::LowerRight
                })
                .draw()
                .map_err(err)?;
        }};
    }
    if s.log_x {
        body!(builder
            .build_cartesian_2d((x0..x1).log_scale(), y0..y1)
            .map_err(err)?);
    } else {
        body!(builder.build_cartesian_2d(x0..x1, y0..y1).map_err(err)?);
    }
    area.present().map_err(err)?;
    Ok(())
}

/// `65536.0` as `64 KiB`.
fn bytes(x: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = x;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.0} {}", UNITS[unit])
}
