//! Receipts signed, verified, and refused when anything in them changed.

use super::*;

fn receipt() -> Receipt {
    Receipt {
        ledger: "ledger-a".into(),
        key: String::new(),
        tenant: "acme".into(),
        operation_id: "refund:o1".into(),
        tool: "refund".into(),
        life: 1_048_577,
        state: State::Confirmed,
        source: "attempt".into(),
        attempt: 1,
        fencing_token: 1_048_577,
        confirmed_by: None,
        result_sha256: Some(result_sha256(br#"{"refund":"re_1"}"#)),
        provider_ref: Some("re_1".into()),
        sequence: 42,
        settled_at: 1_700_000_000_000,
        issued_at: 1_700_000_005_000,
    }
}

#[test]
fn a_receipt_verifies_under_the_key_that_signed_it() {
    let key = SigningKey::from_secret([7; 32]);
    let text = receipt().sign(&key);
    let opened = Receipt::verify(&text, &[key.public()]).unwrap();
    assert_eq!(
        opened,
        Receipt {
            key: key.id().into(),
            ..receipt()
        }
    );
    assert!(opened.covers_result(br#"{"refund":"re_1"}"#));
    assert!(!opened.covers_result(br#"{"refund":"re_2"}"#));
    // The public key as printed, parsed back, verifies it too.
    let printed = PublicKey::parse(&key.public().to_string()).unwrap();
    assert_eq!(printed.id(), key.id());
    assert!(Receipt::verify(&text, &[printed]).is_ok());
}

#[test]
fn a_receipt_with_any_one_byte_changed_is_refused() {
    let key = SigningKey::from_secret([7; 32]);
    let text = receipt().sign(&key);
    let keys = [key.public()];
    for (i, c) in text.char_indices() {
        for other in ['A', 'g', '0', '-', '_', '.'] {
            if other == c {
                continue;
            }
            let mut changed = text.clone();
            changed.replace_range(i..i + 1, &other.to_string());
            assert!(
                Receipt::verify(&changed, &keys).is_err(),
                "byte {i} changed to {other:?} still verifies"
            );
        }
    }
    // The content rewritten and encoded anew, with the original signature: refused.
    let (signed, signature) = text.rsplit_once('.').unwrap();
    let json = URL_SAFE_NO_PAD.decode(&signed[3..]).unwrap();
    let rewritten = String::from_utf8(json)
        .unwrap()
        .replace("\"attempt\":1", "\"attempt\":2");
    let forged = format!("r1.{}.{signature}", URL_SAFE_NO_PAD.encode(rewritten));
    assert_eq!(
        Receipt::verify(&forged, &keys),
        Err(Refused::BadSignature(key.id().into()))
    );
}

#[test]
fn a_receipt_from_another_key_is_refused() {
    let ours = SigningKey::from_secret([7; 32]);
    let theirs = SigningKey::from_secret([8; 32]);
    let text = receipt().sign(&theirs);
    assert_eq!(
        Receipt::verify(&text, &[ours.public()]),
        Err(Refused::UnknownKey(theirs.id().into()))
    );
    // Signed by another key while naming ours: the signature does not hold.
    let (signed, _) = receipt()
        .sign(&ours)
        .rsplit_once('.')
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
        .unwrap();
    let signature = theirs.secret.sign(signed.as_bytes());
    let forged = format!("{signed}.{}", URL_SAFE_NO_PAD.encode(signature.to_bytes()));
    assert_eq!(
        Receipt::verify(&forged, &[ours.public()]),
        Err(Refused::BadSignature(ours.id().into()))
    );
}

#[test]
fn a_rotation_keeps_old_receipts_verifiable() {
    let old = SigningKey::from_secret([7; 32]);
    let new = SigningKey::from_secret([9; 32]);
    let before = receipt().sign(&old);
    let after = receipt().sign(&new);
    let kept = [new.public(), old.public()];
    assert_eq!(Receipt::verify(&before, &kept).unwrap().key, old.id());
    assert_eq!(Receipt::verify(&after, &kept).unwrap().key, new.id());
}

#[test]
fn what_is_not_a_receipt_is_refused_as_such() {
    let key = SigningKey::from_secret([7; 32]);
    let keys = [key.public()];
    let signed = receipt().sign(&key);
    let (_, signature) = signed.rsplit_once('.').unwrap();
    let with = |json: Value| {
        format!(
            "r1.{}.{signature}",
            URL_SAFE_NO_PAD.encode(json.to_string())
        )
    };
    let mut extra = receipt().encode();
    extra["confirmed"] = true.into();
    let mut in_flight = receipt().encode();
    in_flight["state"] = "IN_FLIGHT".into();
    let mut missing = receipt().encode();
    missing.as_object_mut().unwrap().remove("sequence");
    for text in [
        String::new(),
        "p1.abc.def".into(),
        "r1.".into(),
        "r1.e30".into(),
        format!("r1.e30.{signature}"),
        with(extra),
        with(in_flight),
        with(missing),
        "r1.".to_owned() + &"A".repeat(MAX_RECEIPT),
    ] {
        assert!(
            matches!(Receipt::verify(&text, &keys), Err(Refused::Malformed(_))),
            "{text:.60}"
        );
    }
    assert!(PublicKey::parse("not a key").is_err());
    assert!(PublicKey::parse(&URL_SAFE_NO_PAD.encode([0u8; 31])).is_err());
}

proptest::proptest! {
    #[test]
    fn any_text_is_answered(text in "(r1\\.)?[A-Za-z0-9_.=-]{0,300}") {
        let key = SigningKey::from_secret([7; 32]);
        let _ = Receipt::verify(&text, &[key.public()]);
        let _ = Receipt::unverified(&text);
    }
}
