//! How `queueguard consumers` shows consumers: a table, JSON, or JSON lines as they change.

use super::registry::{Change, Consumer};
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};

/// RFC 3339 time of a Unix-millisecond instant.
pub fn rfc3339(ms: i64) -> String {
    Timestamp::from_millisecond(ms).map(|t| t.to_string()).unwrap_or_default()
}

fn ack_mode(c: &Consumer) -> &'static str {
    if c.ack_required { "manual" } else { "auto" }
}

pub fn to_json(c: &Consumer) -> Value {
    json!({
        "queue": c.queue.name,
        "vhost": c.queue.vhost,
        "tag": c.tag,
        "peerHost": c.peer_host,
        "connectionName": c.connection_name,
        "channel": c.channel,
        "prefetch": c.prefetch,
        "ackMode": ack_mode(c),
        "since": rfc3339(c.since_ms),
    })
}

pub fn table(consumers: &[Consumer]) -> String {
    let rows: Vec<[String; 6]> = consumers
        .iter()
        .map(|c| {
            [
                c.tag.clone(),
                c.peer_host.clone().unwrap_or_else(|| "-".into()),
                c.connection_name.clone().unwrap_or_else(|| "-".into()),
                c.prefetch.to_string(),
                ack_mode(c).into(),
                rfc3339(c.since_ms),
            ]
        })
        .collect();
    let header = ["TAG", "PEER", "CONNECTION", "PREFETCH", "ACK", "SINCE"].map(String::from);
    let widths: Vec<usize> =
        (0..6).map(|i| rows.iter().map(|r| r[i].len()).chain([header[i].len()]).max().unwrap_or(0)).collect();
    std::iter::once(&header)
        .chain(rows.iter())
        .map(|row| {
            let cells: Vec<String> = row.iter().zip(&widths).map(|(cell, w)| format!("{cell:<w$}")).collect();
            cells.join("  ").trim_end().to_owned() + "\n"
        })
        .collect()
}

/// One JSON line for `--watch`; None for changes that concern no queue.
pub fn watch_line(change: &Change, at_ms: i64) -> Option<String> {
    let (event, detail) = match change {
        Change::Attached { consumer } => ("attached", to_json(consumer)),
        Change::Detached { consumer } => ("detached", to_json(consumer)),
        Change::QueueDeleted { queue } => ("queue_deleted", json!({"queue": queue.name, "vhost": queue.vhost})),
        Change::Tracking { .. } => return None,
    };
    Some(json!({"time": rfc3339(at_ms), "event": event, "consumer": detail}).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consumers::QueueKey;

    fn consumer(tag: &str, ack: bool) -> Consumer {
        Consumer {
            queue: QueueKey::new("/", "orders"),
            tag: tag.into(),
            channel: "10.0.0.5:4000 -> 10.0.0.9:5672 (1)".into(),
            peer_host: Some("10.0.0.5".into()),
            connection_name: Some("worker-a".into()),
            prefetch: 10,
            ack_required: ack,
            since_ms: 1_764_700_000_000,
            connected_ms: None,
            node: None,
        }
    }

    #[test]
    fn table_aligns_columns() {
        let t = table(&[consumer("ctag-1", true), consumer("t2", false)]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "TAG     PEER      CONNECTION  PREFETCH  ACK     SINCE");
        assert_eq!(lines[1], "ctag-1  10.0.0.5  worker-a    10        manual  2025-12-02T18:26:40Z");
        assert!(lines[2].starts_with("t2      10.0.0.5  worker-a    10        auto "));
    }

    #[test]
    fn watch_lines_are_json_with_time_and_event() {
        let line = watch_line(&Change::Detached { consumer: consumer("t", true) }, 1_764_700_000_500).unwrap();
        assert_eq!(watch_line(&Change::Tracking { vhost: None }, 0), None);
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["event"], "detached");
        assert_eq!(v["time"], "2025-12-02T18:26:40.5Z");
        assert_eq!(v["consumer"]["peerHost"], "10.0.0.5");
    }
}
