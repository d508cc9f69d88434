//! The numbers a scenario ends with, and the table `queueguard demo` prints.

use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub scenario: String,
    pub restarts: u32,
    /// Times a consumer lost its connection and attached again (a broker node restarting).
    pub reconnects: u64,
    /// Messages the broker confirmed.
    pub published: u64,
    /// Distinct messages consumed and acknowledged.
    pub consumed: u64,
    pub lost: u64,
    pub duplicates: u64,
    /// `queue.deleted` events for the queues during the run.
    pub queue_deletions: u64,
    /// Per queue, the fewest consumers attached at any moment of the restarts (0: a moment
    /// with nobody reading it).
    pub fewest_consumers: Vec<usize>,
    /// What the gate reports as unsafe and cannot fix (a StatefulSet of one replica restarts
    /// without a consumer): RolloutSafe's message.
    pub unsafe_strategy: Option<String>,
    /// Longest time a booted pod waited for the gate to open (guarded runs).
    pub longest_gate_wait: Option<Duration>,
    /// Gates opened before their pod's consumer attached (must be 0).
    pub premature_opens: u64,
    /// For each gate opened: the time from its pod's consumer attaching to the gate opening
    /// (minAttachedSeconds included).
    pub gate_overheads: Vec<Duration>,
    /// The live change of the queues' type, where the scenario made one.
    pub migration: Option<Migration>,
}

/// What changing the queues' type live cost, over every queue moved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Migration {
    pub from: String,
    pub to: String,
    pub moved_out: i64,
    pub moved_back: i64,
    /// The longest a queue's name had no queue (delete to declare-ok), in ms.
    pub swap_window_ms: i64,
    /// The longest a queue refused publishes around its swap (publishers with confirms retried).
    pub fenced_ms: i64,
    /// `queue.deleted` events for the queues during the migration (one per queue: the swap).
    pub queue_deletions: u64,
}

impl Migration {
    pub fn line(&self) -> String {
        format!(
            "queue type changed live: {} -> {}; moved out {}, back {}; swap window {} ms, fenced {} ms; {} deletion(s) of the old queue",
            self.from,
            self.to,
            self.moved_out,
            self.moved_back,
            self.swap_window_ms,
            self.fenced_ms,
            self.queue_deletions
        )
    }
}

pub fn table(reports: &[Report]) -> String {
    let header = [
        "scenario",
        "restarts",
        "published",
        "consumed",
        "lost",
        "duplicates",
        "queue deletions",
        "fewest consumers",
        "longest gate wait",
    ];
    let rows: Vec<Vec<String>> = reports
        .iter()
        .map(|r| {
            vec![
                r.scenario.clone(),
                r.restarts.to_string(),
                r.published.to_string(),
                r.consumed.to_string(),
                r.lost.to_string(),
                r.duplicates.to_string(),
                r.queue_deletions.to_string(),
                r.fewest_consumers.iter().map(usize::to_string).collect::<Vec<_>>().join("/"),
                r.longest_gate_wait.map_or_else(|| "-".into(), |d| format!("{:.2}s", d.as_secs_f64())),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..header.len())
        .map(|i| rows.iter().map(|r| r[i].len()).chain([header[i].len()]).max().unwrap_or(0))
        .collect();
    let line = |cells: Vec<String>| -> String {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (c, w))| if i == 0 { format!("{c:<w$}") } else { format!("{c:>w$}") })
            .collect();
        padded.join("  ") + "\n"
    };
    std::iter::once(line(header.iter().map(|s| s.to_string()).collect())).chain(rows.into_iter().map(line)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_lines_up() {
        let r = Report {
            scenario: "guarded".into(),
            restarts: 10,
            reconnects: 0,
            published: 2000,
            consumed: 2000,
            lost: 0,
            duplicates: 3,
            queue_deletions: 0,
            fewest_consumers: vec![2, 1],
            unsafe_strategy: None,
            longest_gate_wait: Some(Duration::from_millis(850)),
            premature_opens: 0,
            gate_overheads: vec![],
            migration: None,
        };
        let t = table(&[r.clone(), Report { scenario: "naive".into(), lost: 120, longest_gate_wait: None, ..r }]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0],
            "scenario  restarts  published  consumed  lost  duplicates  queue deletions  fewest consumers  longest gate wait"
        );
        assert_eq!(
            lines[1],
            "guarded         10       2000      2000     0           3                0               2/1              0.85s"
        );
        assert!(lines[2].starts_with("naive ") && lines[2].ends_with("  -"));
    }
}
