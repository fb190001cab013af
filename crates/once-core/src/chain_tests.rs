//! Links written and checked, and each way a history can be rewritten, caught.

use super::*;

fn event(sequence: i64, operation: &str, state: &str) -> Recorded {
    Recorded {
        sequence,
        tenant: "t".into(),
        operation_id: operation.into(),
        life: 7,
        at: 1_000 + sequence,
        kind: if state == "CONFIRMED" {
            "CONFIRMED"
        } else {
            "CLAIMED"
        }
        .into(),
        from_state: Some("IN_FLIGHT".into()),
        to_state: Some(state.into()),
        state: Some(state.into()),
        tool: Some("refund".into()),
        attempt: Some(1),
        actor: "executor:mcp".into(),
        reason: None,
        details: Some(r#"{"a":1}"#.into()),
        dedupe_key: None,
    }
}

fn history() -> Vec<Stored> {
    vec![
        (event(3, "a", "IN_FLIGHT"), None),
        (
            event(5, "a", "CONFIRMED"),
            Some((b"paid".to_vec(), Some("re_1".into()))),
        ),
        (event(8, "b", "IN_FLIGHT"), None),
    ]
}

fn linked(stored: &[Stored], before: Option<&Link>) -> Link {
    let entries: Vec<Entry> = stored
        .iter()
        .map(|(e, r)| entry(e, r.as_ref().map(|(b, p)| (b.as_slice(), p.as_deref()))))
        .collect();
    next_link("t", before, &entries, 9, 2_000)
}

#[test]
fn an_untouched_history_checks_and_links_follow_one_another() {
    let stored = history();
    let first = linked(&stored, None);
    assert_eq!(
        (first.number, first.after, first.previous.as_str()),
        (1, 0, "")
    );
    assert_eq!(check_link(&first, None, &stored, 0), Ok(3));
    let second = linked(&[(event(12, "c", "IN_FLIGHT"), None)], Some(&first));
    assert_eq!((second.number, second.after), (2, 9));
    assert_eq!(second.previous, first.hash);
    assert_eq!(
        check_link(
            &second,
            Some(&first),
            &[(event(12, "c", "IN_FLIGHT"), None)],
            0
        ),
        Ok(1)
    );
    assert_eq!(decode_entries(&first.entries).unwrap().len(), 3);
    assert_eq!(decode_entries("1:ab"), None);
    assert_eq!(decode_entries(""), Some(vec![]));
}

#[test]
fn each_way_of_rewriting_the_history_is_named() {
    let stored = history();
    let link = linked(&stored, None);
    // A column of an event changed.
    let mut changed = stored.clone();
    changed[0].0.reason = Some("edited".into());
    assert_eq!(
        check_link(&link, None, &changed, 0),
        Err(Problem::Changed {
            sequence: 3,
            operation_id: "a".into()
        })
    );
    // The state an event recorded.
    let mut changed = stored.clone();
    changed[2].0.state = Some("CONFIRMED".into());
    assert_eq!(
        check_link(&link, None, &changed, 0).unwrap_err().sequence(),
        Some(8)
    );
    // A result.
    let mut changed = stored.clone();
    changed[1].1 = Some((b"paid twice".to_vec(), Some("re_1".into())));
    assert_eq!(
        check_link(&link, None, &changed, 0),
        Err(Problem::Result {
            sequence: 5,
            operation_id: "a".into()
        })
    );
    // A result whose operation retention since deleted proves nothing either way.
    let mut deleted = stored.clone();
    deleted[1].1 = None;
    assert_eq!(check_link(&link, None, &deleted, 0), Ok(3));
    // An event removed, unless retention deleted that far.
    let removed: Vec<Stored> = vec![stored[0].clone(), stored[2].clone()];
    assert_eq!(
        check_link(&link, None, &removed, 4),
        Err(Problem::Missing { sequence: 5 })
    );
    assert_eq!(check_link(&link, None, &removed, 5), Ok(3));
    // An event added, before the last entry or after it.
    let mut added = stored.clone();
    added.insert(1, (event(4, "x", "IN_FLIGHT"), None));
    assert_eq!(
        check_link(&link, None, &added, 0).unwrap_err().code(),
        "EVENT_ADDED"
    );
    let mut added = stored.clone();
    added.push((event(9, "x", "IN_FLIGHT"), None));
    assert_eq!(
        check_link(&link, None, &added, 0).unwrap_err().sequence(),
        Some(9)
    );
}

#[test]
fn a_rewritten_link_breaks_its_hash_or_the_one_after() {
    let stored = history();
    let first = linked(&stored, None);
    // Its entries rewritten to match an edited event: its hash no longer matches.
    let mut forged = first.clone();
    forged.entries = forged.entries.replacen('3', "4", 1);
    assert_eq!(
        check_link(&forged, None, &stored, 0).unwrap_err().code(),
        "LINK"
    );
    // Rewritten with a new hash: the next link no longer follows it.
    let mut rehashed = forged.clone();
    rehashed.hash = link_hash("t", (1, 0, 9), &rehashed.entries, "");
    let second = linked(&[(event(12, "c", "IN_FLIGHT"), None)], Some(&first));
    let shown = check_link(
        &second,
        Some(&rehashed),
        &[(event(12, "c", "IN_FLIGHT"), None)],
        0,
    );
    assert_eq!(
        shown,
        Err(Problem::Link {
            number: 2,
            why: "does not follow the link before it"
        })
    );
}
