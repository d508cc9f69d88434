//! Reading `amq.rabbitmq.event` messages (rabbitmq_event_exchange): the routing key names the
//! event, the headers carry its properties.

use super::registry::{BrokerEvent, QueueKey};
use lapin::types::{AMQPValue, FieldTable};

/// The routing keys queueguard subscribes to.
pub const BINDINGS: [&str; 5] = ["consumer.*", "channel.*", "connection.created", "connection.closed", "queue.deleted"];

/// Parses one event; None for events queueguard does not use or cannot read.
pub fn parse(routing_key: &str, headers: &FieldTable) -> Option<BrokerEvent> {
    let h = Headers(headers);
    Some(match routing_key {
        "connection.created" => BrokerEvent::ConnectionCreated {
            pid: h.string("pid")?,
            name: h.string("name")?,
            vhost: h.string("vhost")?,
            user_provided_name: h.string("user_provided_name"),
            connected_ms: h.int("connected_at"),
        },
        "connection.closed" => BrokerEvent::ConnectionClosed { pid: h.string("pid")?, name: h.string("name") },
        "channel.created" => {
            BrokerEvent::ChannelCreated { pid: h.string("pid")?, name: h.string("name")?, vhost: h.string("vhost")? }
        }
        "channel.closed" => BrokerEvent::ChannelClosed { pid: h.string("pid")? },
        "consumer.created" => BrokerEvent::ConsumerCreated {
            channel_pid: h.string("channel")?,
            queue: QueueKey::new(h.string("vhost")?, h.string("queue")?),
            tag: h.string("consumer_tag")?,
            prefetch: h.int("prefetch_count").and_then(|n| u32::try_from(n).ok()).unwrap_or(0),
            ack_required: h.bool("ack_required").unwrap_or(true),
            at_ms: h.int("timestamp_in_ms")?,
        },
        "consumer.deleted" => BrokerEvent::ConsumerDeleted {
            channel_pid: h.string("channel")?,
            queue: QueueKey::new(h.string("vhost")?, h.string("queue")?),
            tag: h.string("consumer_tag")?,
        },
        "queue.deleted" => BrokerEvent::QueueDeleted { queue: QueueKey::new(h.string("vhost")?, h.string("name")?) },
        _ => return None,
    })
}

struct Headers<'a>(&'a FieldTable);

impl Headers<'_> {
    fn get(&self, key: &str) -> Option<&AMQPValue> {
        self.0.inner().iter().find(|(k, _)| k.as_str() == key).map(|(_, v)| v)
    }

    fn string(&self, key: &str) -> Option<String> {
        match self.get(key)? {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            AMQPValue::ShortString(s) => Some(s.to_string()),
            _ => None,
        }
        .filter(|s| !s.is_empty())
    }

    fn int(&self, key: &str) -> Option<i64> {
        Some(match self.get(key)? {
            AMQPValue::LongLongInt(n) => *n,
            AMQPValue::LongInt(n) => i64::from(*n),
            AMQPValue::LongUInt(n) => i64::from(*n),
            AMQPValue::ShortInt(n) => i64::from(*n),
            AMQPValue::ShortUInt(n) => i64::from(*n),
            AMQPValue::Timestamp(n) => i64::try_from(*n).ok()?,
            _ => return None,
        })
    }

    fn bool(&self, key: &str) -> Option<bool> {
        match self.get(key)? {
            AMQPValue::Boolean(b) => Some(*b),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert((*k).into(), v.clone());
        }
        t
    }

    fn s(v: &str) -> AMQPValue {
        AMQPValue::LongString(v.into())
    }

    #[test]
    fn consumer_created_as_rabbitmq_3_10_sends_it() {
        let headers = table(&[
            ("user_who_performed_action", s("guest")),
            ("arguments", AMQPValue::FieldArray(Default::default())),
            ("prefetch_count", AMQPValue::LongLongInt(7)),
            ("queue", s("orders")),
            ("vhost", s("/")),
            ("channel", s("<rabbit@localhost.1796237705.17522.0>")),
            ("ack_required", AMQPValue::Boolean(false)),
            ("exclusive", AMQPValue::Boolean(false)),
            ("consumer_tag", s("ctag1")),
            ("timestamp_in_ms", AMQPValue::LongLongInt(1_796_247_179_014)),
        ]);
        assert_eq!(
            parse("consumer.created", &headers),
            Some(BrokerEvent::ConsumerCreated {
                channel_pid: "<rabbit@localhost.1796237705.17522.0>".into(),
                queue: QueueKey::new("/", "orders"),
                tag: "ctag1".into(),
                prefetch: 7,
                ack_required: false,
                at_ms: 1_796_247_179_014,
            })
        );
    }

    #[test]
    fn connection_and_channel_events() {
        let conn = table(&[
            ("pid", s("<k>")),
            ("name", s("10.0.0.5:4000 -> 10.0.0.9:5672")),
            ("vhost", s("orders")),
            ("user_provided_name", s("worker-1")),
            ("connected_at", AMQPValue::LongLongInt(1_796_400_161_952)),
        ]);
        assert_eq!(
            parse("connection.created", &conn),
            Some(BrokerEvent::ConnectionCreated {
                pid: "<k>".into(),
                name: "10.0.0.5:4000 -> 10.0.0.9:5672".into(),
                vhost: "orders".into(),
                user_provided_name: Some("worker-1".into()),
                connected_ms: Some(1_796_400_161_952),
            })
        );
        let unnamed = table(&[("pid", s("<k>")), ("name", s("n")), ("vhost", s("/"))]);
        assert!(matches!(
            parse("connection.created", &unnamed),
            Some(BrokerEvent::ConnectionCreated { user_provided_name: None, .. })
        ));
        let chan = table(&[
            ("pid", s("<c>")),
            ("name", s("10.0.0.5:4000 -> 10.0.0.9:5672 (1)")),
            ("vhost", s("/")),
            ("number", AMQPValue::LongLongInt(1)),
        ]);
        assert_eq!(
            parse("channel.created", &chan),
            Some(BrokerEvent::ChannelCreated {
                pid: "<c>".into(),
                name: "10.0.0.5:4000 -> 10.0.0.9:5672 (1)".into(),
                vhost: "/".into()
            })
        );
        assert_eq!(
            parse("connection.closed", &table(&[("pid", s("<k>")), ("name", s("n")), ("node", s("rabbit@a"))])),
            Some(BrokerEvent::ConnectionClosed { pid: "<k>".into(), name: Some("n".into()) })
        );
        assert_eq!(
            parse("channel.closed", &table(&[("pid", s("<c>"))])),
            Some(BrokerEvent::ChannelClosed { pid: "<c>".into() })
        );
        let q = table(&[("name", s("orders")), ("vhost", s("v"))]);
        assert_eq!(parse("queue.deleted", &q), Some(BrokerEvent::QueueDeleted { queue: QueueKey::new("v", "orders") }));
    }

    #[test]
    fn unknown_or_incomplete_events_are_skipped() {
        assert_eq!(parse("user.authentication.success", &table(&[])), None);
        assert_eq!(parse("consumer.created", &table(&[("queue", s("q"))])), None);
    }
}
