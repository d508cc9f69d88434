//! Which queues of a vhost its shared listing asks the management API for. A vhost that holds
//! many queues the operator does not read (thousands of RPC reply queues beside a few governed
//! ones) is listed through the API's name filter: one page holding only the queues some policy
//! names or some pattern matches, so the broker gathers no statistics for the rest. A small vhost,
//! or one whose wanted queues would not fit one page, is listed whole: one request either way.

use regex::Regex;
use std::collections::BTreeSet;

/// The management API's largest page.
pub const PAGE_SIZE: usize = 500;
/// Queues in a vhost above which its listing is filtered.
pub const FILTER_ABOVE: usize = 1000;
/// The longest filter sent (a regex in the query string); a longer one lists the vhost whole.
pub const MAX_FILTER: usize = 2000;

/// What a reader of a listing needs from it.
#[derive(Debug, Clone, Copy)]
pub enum Want<'a> {
    /// These queues (a QueuePolicy's queue and dead-letter queue).
    Queues(&'a [&'a str]),
    /// The queues a QueuePattern's regex matches.
    Pattern(&'a str),
}

/// Every queue of a vhost some reader asked for, so far. Names are kept after their policy
/// goes: a stale name only lengthens the filter, and past [`MAX_FILTER`] the vhost is listed whole.
/// A pattern goes when its QueuePattern does ([`Wanted::remove_pattern`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Wanted {
    names: BTreeSet<String>,
    patterns: BTreeSet<String>,
}

/// Whether a pattern can stand in the joined filter without changing how the rest reads. Each is
/// valid alone (the broker took it in a policy), but the broker's regex engine reads an `x` flag
/// as "comments from `#` to the end of the line", across the closing of the pattern's group: one
/// such pattern turned the whole filter into a refused request, and every reader of the vhost's
/// listing with it. A pattern that is not a valid regex here cannot be judged either.
pub fn joinable(pattern: &str) -> bool {
    static EXTENDED: std::sync::LazyLock<Regex> =
        std::sync::LazyLock::new(|| Regex::new(r"\(\?[a-zA-Z-]*x").expect("a valid regex"));
    Regex::new(pattern).is_ok() && !pattern.contains('#') && !pattern.contains('\n') && !EXTENDED.is_match(pattern)
}

impl Wanted {
    /// Adds what `want` needs; allocates only for what is new (it runs on every look).
    pub fn add(&mut self, want: Want) {
        match want {
            Want::Queues(names) => {
                for name in names {
                    if !self.names.contains(*name) {
                        self.names.insert((*name).to_owned());
                    }
                }
            }
            Want::Pattern(p) if !self.patterns.contains(p) => {
                self.patterns.insert(p.to_owned());
            }
            Want::Pattern(_) => {}
        }
    }

    /// Forgets a pattern nobody reads any more.
    pub fn remove_pattern(&mut self, pattern: &str) {
        self.patterns.remove(pattern);
    }

    pub fn covers(&self, want: Want) -> bool {
        match want {
            Want::Queues(names) => names.iter().all(|n| self.names.contains(*n)),
            Want::Pattern(p) => self.patterns.contains(p),
        }
    }

    /// The regex for the API's `name` filter: the names exactly, and each pattern as it stands
    /// (the same regex its broker policy gives RabbitMQ).
    pub fn regex(&self) -> String {
        let names = (!self.names.is_empty()).then(|| {
            let alternatives: Vec<String> = self.names.iter().map(|n| regex_escape(n)).collect();
            format!("^(?:{})$", alternatives.join("|"))
        });
        names.into_iter().chain(self.patterns.iter().map(|p| format!("(?:{p})"))).collect::<Vec<_>>().join("|")
    }

    /// How many of `names` it wants.
    pub fn count_in<'a>(&self, names: impl Iterator<Item = &'a str>) -> usize {
        let patterns: Vec<Regex> = self.patterns.iter().filter_map(|p| Regex::new(p).ok()).collect();
        names.filter(|n| self.names.contains(*n) || patterns.iter().any(|re| re.is_match(n))).count()
    }
}

/// What the vhost's last listing showed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Seen {
    /// Queues in the vhost.
    pub total: usize,
    /// Of them, wanted ones.
    pub wanted: usize,
}

/// The name filter for the next listing, or None to list the vhost whole: filtered only where
/// the last listing showed many queues, the wanted ones fit one page with room to grow, and the
/// filter is short enough for a URL.
/// A pattern that cannot stand in the joined filter ([`joinable`]), or a filter the broker
/// refused (`refused`), lists the vhost whole.
pub fn filter(wanted: &Wanted, last: Option<Seen>, refused: Option<&str>) -> Option<String> {
    let last = last?;
    if last.total <= FILTER_ABOVE || last.wanted > PAGE_SIZE / 2 {
        return None;
    }
    if !wanted.patterns.iter().all(|p| joinable(p)) {
        return None;
    }
    Some(wanted.regex()).filter(|re| !re.is_empty() && re.len() <= MAX_FILTER && Some(re.as_str()) != refused)
}

/// Escapes `text` for a regex (RabbitMQ's and this crate's alike).
pub fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.^$|?*+()[]{}".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wanted() -> Wanted {
        let mut w = Wanted::default();
        w.add(Want::Queues(&["orders", "orders.dlq"]));
        w.add(Want::Pattern("^rpc\\.reply\\."));
        w
    }

    #[test]
    fn the_filter_names_the_queues_exactly_and_keeps_each_pattern() {
        let w = wanted();
        assert_eq!(w.regex(), r"^(?:orders|orders\.dlq)$|(?:^rpc\.reply\.)");
        let re = Regex::new(&w.regex()).unwrap();
        let listed = ["orders", "orders.dlq", "orders2", "xorders", "rpc.reply.1", "other.rpc.reply.1"];
        let hits: Vec<&str> = listed.iter().copied().filter(|n| re.is_match(n)).collect();
        assert_eq!(hits, ["orders", "orders.dlq", "rpc.reply.1"]);
        assert_eq!(w.count_in(listed.iter().copied()), 3, "counted as the broker would filter");
        assert!(w.covers(Want::Queues(&["orders.dlq"])) && !w.covers(Want::Queues(&["orders", "billing"])));
        assert!(w.covers(Want::Pattern("^rpc\\.reply\\.")) && !w.covers(Want::Pattern("^rpc")));
        assert_eq!(super::regex_escape("rpc.reply(1)*"), r"rpc\.reply\(1\)\*");
    }

    #[test]
    fn only_a_large_vhost_whose_wanted_queues_fit_a_page_is_filtered() {
        let w = wanted();
        assert_eq!(filter(&w, None, None), None, "the first listing is whole: it shows how many there are");
        assert_eq!(filter(&w, Some(Seen { total: FILTER_ABOVE, wanted: 3 }), None), None, "a small vhost");
        assert_eq!(filter(&w, Some(Seen { total: 20_000, wanted: 3 }), None), Some(w.regex()));
        let many = Some(Seen { total: 20_000, wanted: 400 });
        assert_eq!(filter(&w, many, None), None, "would not fit a page as it grows");
        let nothing = Some(Seen { total: 20_000, wanted: 0 });
        assert_eq!(filter(&Wanted::default(), nothing, None), None, "nothing wanted yet");
        let mut long = Wanted::default();
        let names: Vec<String> = (0..200).map(|i| format!("queue-with-a-long-name-{i}")).collect();
        long.add(Want::Queues(&names.iter().map(String::as_str).collect::<Vec<_>>()));
        assert_eq!(filter(&long, Some(Seen { total: 20_000, wanted: 200 }), None), None, "too long for a URL");
    }

    #[test]
    fn a_pattern_that_would_change_how_the_others_read_lists_the_vhost_whole() {
        let big = Some(Seen { total: 20_000, wanted: 3 });
        for bad in ["(?x)^rpc # replies", "(?ix:^rpc)", "^a#b", "(unbalanced"] {
            assert!(!joinable(bad), "{bad}");
            let mut w = wanted();
            w.add(Want::Pattern(bad));
            assert_eq!(filter(&w, big, None), None, "{bad}");
            w.remove_pattern(bad);
            assert_eq!(filter(&w, big, None), Some(w.regex()), "its QueuePattern gone, {bad} is forgotten");
        }
        for good in ["^rpc\\.reply\\.", "(?i)^Orders", "^amq\\.gen-"] {
            assert!(joinable(good), "{good}");
        }
        let w = wanted();
        assert_eq!(filter(&w, big, Some(&w.regex())), None, "a filter the broker refused is not sent again");
    }
}
