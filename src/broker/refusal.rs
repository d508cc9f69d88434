//! The broker's channel-level refusals (406, 404, 403, 405) and what they say.
//!
//! RabbitMQ explains an inequivalent re-declare only in its reply text, in a few shapes:
//! `inequivalent arg 'x-expires' for queue 'q' in vhost '/': received '1800000' but current is
//! '600000'`, or `received none but current is the value '600000' of type 'signedint'`.

use std::fmt;

/// An AMQP soft error: the broker refused one operation and closed the channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: u16,
    pub text: String,
}

pub const NOT_FOUND: u16 = 404;
pub const ACCESS_REFUSED: u16 = 403;
pub const RESOURCE_LOCKED: u16 = 405;
pub const PRECONDITION_FAILED: u16 = 406;

/// One argument on which an existing entity and a declare disagree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inequivalence {
    pub argument: String,
    /// What the declare sent; None when it did not send the argument.
    pub received: Option<String>,
    /// What the existing entity has; None when it has no such argument.
    pub current: Option<String>,
}

impl Refusal {
    /// The inequivalent argument, when this is a 406 about one.
    pub fn inequivalence(&self) -> Option<Inequivalence> {
        if self.code != PRECONDITION_FAILED {
            return None;
        }
        let after = self.text.split_once("inequivalent arg '")?.1;
        let (argument, rest) = after.split_once('\'')?;
        let rest = rest.split_once("received ")?.1;
        let (received, rest) = rest.split_once(" but current is ")?;
        Some(Inequivalence { argument: argument.to_owned(), received: value_of(received), current: value_of(rest) })
    }
}

/// `none`, `'v'`, or `the value 'v' of type 't'` → the value.
fn value_of(s: &str) -> Option<String> {
    let s = s.trim();
    if s.starts_with("none") {
        return None;
    }
    let s = s.strip_prefix("the value ").unwrap_or(s);
    let inner = s.strip_prefix('\'')?;
    let end = inner.find('\'')?;
    Some(inner[..end].to_owned())
}

impl fmt::Display for Inequivalence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |v: &Option<String>| v.as_ref().map_or_else(|| "unset".to_owned(), |v| format!("{v:?}"));
        write!(
            f,
            "argument {} is {} on the broker but this policy declares {}",
            self.argument,
            show(&self.current),
            show(&self.received)
        )?;
        // What RabbitMQ 4.3 refuses at declaration: the queue cannot be declared again as it is.
        let refused = match (self.argument.as_str(), self.current.as_deref()) {
            ("x-queue-mode", Some(_)) => Some("x-queue-mode"),
            ("x-queue-version", Some("1")) => Some("x-queue-version 1"),
            ("durable", Some("false")) => Some("transient (non-durable) queues that are not exclusive"),
            _ => None,
        };
        if let Some(what) = refused {
            write!(
                f,
                "; RabbitMQ 4.3 refuses {what} at declaration, so an application that declares this queue as it is fails after a broker upgrade"
            )?;
        }
        Ok(())
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.text, self.code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(text: &str) -> Refusal {
        Refusal { code: PRECONDITION_FAILED, text: text.into() }
    }

    #[test]
    fn reads_both_values_when_both_are_set() {
        let r = refusal(
            "PRECONDITION_FAILED - inequivalent arg 'x-expires' for queue 'q' in vhost '/': received '1800000' but current is '600000'",
        );
        let i = r.inequivalence().unwrap();
        assert_eq!(i.argument, "x-expires");
        assert_eq!(i.received.as_deref(), Some("1800000"));
        assert_eq!(i.current.as_deref(), Some("600000"));
        assert_eq!(
            i.to_string(),
            "argument x-expires is \"600000\" on the broker but this policy declares \"1800000\""
        );
    }

    #[test]
    fn reads_missing_and_typed_values() {
        let r = refusal(
            "PRECONDITION_FAILED - inequivalent arg 'x-expires' for queue 'q' in vhost '/': received none but current is the value '600000' of type 'signedint'",
        );
        let i = r.inequivalence().unwrap();
        assert_eq!((i.received, i.current.as_deref()), (None, Some("600000")));
        let r = refusal(
            "PRECONDITION_FAILED - inequivalent arg 'x-max-length' for queue 'q' in vhost 'v': received the value '10' of type 'long' but current is none",
        );
        let i = r.inequivalence().unwrap();
        assert_eq!((i.received.as_deref(), i.current.as_deref()), (Some("10"), None));
        assert!(i.to_string().contains("unset on the broker"));
    }

    #[test]
    fn what_rabbitmq_4_3_refuses_is_said() {
        let lazy = refusal(
            "PRECONDITION_FAILED - inequivalent arg 'x-queue-mode' for queue 'q' in vhost '/': received none but current is the value 'lazy' of type 'longstr'",
        );
        assert!(lazy.inequivalence().unwrap().to_string().ends_with("fails after a broker upgrade"));
        let v2 = refusal(
            "PRECONDITION_FAILED - inequivalent arg 'x-queue-version' for queue 'q' in vhost '/': received none but current is the value '2' of type 'signedint'",
        );
        assert!(!v2.inequivalence().unwrap().to_string().contains("4.3"));
        let transient = refusal(
            "PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'q' in vhost '/': received 'true' but current is 'false'",
        );
        assert!(transient.inequivalence().unwrap().to_string().contains("refuses transient (non-durable) queues"));
    }

    #[test]
    fn reads_durable_and_exchange_type() {
        let r = refusal(
            "PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'q' in vhost '/': received 'true' but current is 'false'",
        );
        assert_eq!(r.inequivalence().unwrap().argument, "durable");
        let r = refusal(
            "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'x' in vhost '/': received 'direct' but current is 'topic'",
        );
        let i = r.inequivalence().unwrap();
        assert_eq!((i.argument.as_str(), i.current.as_deref()), ("type", Some("topic")));
    }

    #[test]
    fn other_refusals_are_not_inequivalences() {
        assert!(
            Refusal { code: NOT_FOUND, text: "NOT_FOUND - no exchange 'e' in vhost '/'".into() }
                .inequivalence()
                .is_none()
        );
        assert!(refusal("PRECONDITION_FAILED - queue 'q' in vhost '/' not empty").inequivalence().is_none());
    }
}
