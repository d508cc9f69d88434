//! Human durations (`30m`, `2h`, `1h30m`, `500ms`) as QueuePolicy fields carry them.
//!
//! The accepted grammar is the subset of Go's `time.ParseDuration` that the API server's CEL
//! `duration()` also reads, so the CRD's validation rules and the operator agree on every value.

use std::{fmt, time::Duration};

/// The pattern the CRD puts on every duration field.
pub const PATTERN: &str = "^([0-9]+(ms|s|m|h))+$";

/// A duration field as a resource gives it: the text, kept as written so that a bad value
/// reaches the plan and is reported as a field error (a type that refused it would make the
/// watch drop the whole object), with [`PATTERN`] in its schema.
#[derive(serde::Serialize, serde::Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(transparent)]
pub struct DurationText(pub String);

impl DurationText {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<&str> for DurationText {
    fn from(text: &str) -> Self {
        Self(text.to_owned())
    }
}

impl schemars::JsonSchema for DurationText {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Duration".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({ "type": "string", "pattern": PATTERN, "maxLength": 32 })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid duration {input:?}: {why} (use whole numbers with ms, s, m or h, as in 90s, 30m, 1h30m)")]
pub struct DurationError {
    input: String,
    why: &'static str,
}

/// Parses `1h30m`, `45s`, `250ms`. No fractions, signs, spaces or days: `24h` is a day.
pub fn parse(input: &str) -> Result<Duration, DurationError> {
    let err = |why| DurationError { input: input.to_owned(), why };
    if input.is_empty() {
        return Err(err("empty"));
    }
    let mut total_ms: u64 = 0;
    let mut rest = input;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(err("expected a number"));
        }
        let value: u64 = rest[..digits].parse().map_err(|_| err("number too large"))?;
        rest = &rest[digits..];
        let unit_len = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
        let per_unit_ms = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "" => return Err(err("missing unit")),
            _ => return Err(err("unknown unit")),
        };
        rest = &rest[unit_len..];
        total_ms = value
            .checked_mul(per_unit_ms)
            .and_then(|ms| total_ms.checked_add(ms))
            .ok_or_else(|| err("number too large"))?;
    }
    Ok(Duration::from_millis(total_ms))
}

/// Formats a duration in the same grammar, largest units first (`5400s` → `1h30m`).
pub struct Human(pub Duration);

impl fmt::Display for Human {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut ms = self.0.as_millis();
        if ms == 0 {
            return f.write_str("0s");
        }
        for (unit, size) in [("h", 3_600_000), ("m", 60_000), ("s", 1_000), ("ms", 1)] {
            if ms >= size {
                write!(f, "{}{unit}", ms / size)?;
                ms %= size;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_forms() {
        let cases = [
            ("30m", 1_800_000),
            ("2h", 7_200_000),
            ("1h30m", 5_400_000),
            ("90s", 90_000),
            ("250ms", 250),
            ("1m500ms", 60_500),
            ("0s", 0),
        ];
        for (input, ms) in cases {
            assert_eq!(parse(input), Ok(Duration::from_millis(ms)), "{input}");
        }
    }

    #[test]
    fn rejects_what_cel_duration_would_not_read_the_same_way() {
        for input in ["", "30", "m", "1d", "1.5h", "-1m", "30 m", "30M", "1h30", "99999999999999999999h"] {
            let err = parse(input).unwrap_err();
            assert!(err.to_string().contains(&format!("{input:?}")), "{err}");
        }
    }

    #[test]
    fn pattern_accepts_exactly_what_the_parser_accepts() {
        let pattern = regex::Regex::new(PATTERN).unwrap();
        for input in ["30m", "1h30m", "1d", "5", "10ms", "1m1s1ms", "h1", "1hm", "", "0s", "1.5h"] {
            assert_eq!(pattern.is_match(input), parse(input).is_ok(), "{input}");
        }
    }

    #[test]
    fn formats_largest_units_first() {
        assert_eq!(Human(Duration::from_secs(5400)).to_string(), "1h30m");
        assert_eq!(Human(Duration::from_millis(60_500)).to_string(), "1m500ms");
        assert_eq!(Human(Duration::ZERO).to_string(), "0s");
        for s in ["30m", "2h", "1h30m", "250ms"] {
            assert_eq!(Human(parse(s).unwrap()).to_string(), s);
        }
    }
}
