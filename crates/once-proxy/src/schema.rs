//! What an upstream's JSON Schemas say of the values a policy reads: whether a path into a
//! tool's arguments is there (for `once-proxy check`) and whether it holds an integer (for
//! the guard). The upstream writes the schemas: every walk is bounded, whatever they reference.

use serde_json::Value;

/// How deep a walk follows `$ref`s, alternatives and members before it cannot tell.
const MAX_DEPTH: usize = 32;

/// What a JSON Schema says of a path into the values it describes.
#[derive(Debug, Clone, PartialEq)]
pub enum Found<'s> {
    /// It is there, described by `at`; `required` when every object on the way requires the
    /// next member.
    Yes { required: bool, at: &'s Value },
    /// An object on the way lists its members, and this one is not among them.
    No { member: String, has: Vec<String> },
    /// The schema does not say (no `properties`, or other members allowed).
    CannotTell,
}

/// Follows `path` through `schema` (its `properties`, `items`, local `$ref`s and the
/// alternatives of `anyOf`, `oneOf` and `allOf`), `root` being the schema `$ref`s point into.
pub fn find<'s>(root: &'s Value, schema: &'s Value, path: &[String], depth: usize) -> Found<'s> {
    if depth > MAX_DEPTH {
        return Found::CannotTell;
    }
    if let Some(target) = schema.get("$ref").and_then(Value::as_str) {
        return match target.strip_prefix('#').and_then(|p| root.pointer(p)) {
            Some(target) => find(root, target, path, depth + 1),
            None => Found::CannotTell,
        };
    }
    let Some((member, rest)) = path.split_first() else {
        return Found::Yes {
            required: true,
            at: schema,
        };
    };
    let alternatives: Vec<&Value> = ["anyOf", "oneOf", "allOf"]
        .iter()
        .filter_map(|k| schema.get(*k).and_then(Value::as_array))
        .flatten()
        .collect();
    if !alternatives.is_empty() {
        let found: Vec<Found<'s>> = alternatives
            .iter()
            .map(|alt| find(root, alt, path, depth + 1))
            .collect();
        if let Some(yes) = found.iter().find(|f| matches!(f, Found::Yes { .. })) {
            return yes.clone();
        }
        if found.iter().all(|f| matches!(f, Found::No { .. })) {
            return found.into_iter().next().expect("not empty");
        }
        return Found::CannotTell;
    }
    if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
        if let Some(inner) = properties.get(member) {
            let required = schema
                .get("required")
                .and_then(Value::as_array)
                .is_some_and(|r| r.iter().any(|n| n.as_str() == Some(member)));
            return match find(root, inner, rest, depth + 1) {
                Found::Yes {
                    required: deeper,
                    at,
                } => Found::Yes {
                    required: required && deeper,
                    at,
                },
                other => other,
            };
        }
        let open = matches!(schema.get("additionalProperties"), Some(v) if v != &Value::Bool(false))
            || schema.get("patternProperties").is_some();
        if open {
            return Found::CannotTell;
        }
        return Found::No {
            member: member.clone(),
            has: properties.keys().cloned().collect(),
        };
    }
    if let (Some(items), Ok(_)) = (schema.get("items"), member.parse::<usize>()) {
        return find(root, items, rest, depth + 1);
    }
    Found::CannotTell
}

/// Whether `schema` (in `root`, which its `$ref`s point into) admits an integer: its `type`
/// says so, or one of its `anyOf`, `oneOf` or `allOf` does (pydantic's `Optional[int]`).
pub fn admits_integer(root: &Value, schema: &Value) -> bool {
    admits_integer_within(root, schema, 0)
}

fn admits_integer_within(root: &Value, schema: &Value, depth: usize) -> bool {
    if depth > MAX_DEPTH {
        return false;
    }
    if let Some(target) = schema.get("$ref").and_then(Value::as_str) {
        return target
            .strip_prefix('#')
            .and_then(|p| root.pointer(p))
            .is_some_and(|target| admits_integer_within(root, target, depth + 1));
    }
    let typed = match schema.get("type") {
        Some(Value::String(kind)) => kind == "integer",
        Some(Value::Array(kinds)) => kinds.iter().any(|k| k == "integer"),
        _ => false,
    };
    typed
        || ["anyOf", "oneOf", "allOf"]
            .iter()
            .filter_map(|k| schema.get(*k).and_then(Value::as_array))
            .flatten()
            .any(|alt| admits_integer_within(root, alt, depth + 1))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn path(pointer: &str) -> Vec<String> {
        pointer.split('/').skip(1).map(str::to_owned).collect()
    }

    /// The shapes SDKs write input schemas in: pydantic's `$defs` and `$ref`, optional fields
    /// as `anyOf` with null, zod's `additionalProperties: false`, arrays.
    #[test]
    fn paths_are_followed_through_the_shapes_sdks_write() {
        let schema = json!({
            "type": "object",
            "properties": {
                "order_id": {"type": "string"},
                "customer": {"$ref": "#/$defs/Customer"},
                "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "lines": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string"}}}},
                "extra": {"type": "object", "additionalProperties": true},
            },
            "required": ["order_id", "customer"],
            "additionalProperties": false,
            "$defs": {"Customer": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}},
        });
        let found = |pointer: &str| find(&schema, &schema, &path(pointer), 0);
        let required = |pointer: &str| match found(pointer) {
            Found::Yes { required, .. } => Some(required),
            _ => None,
        };
        assert_eq!(required("/order_id"), Some(true));
        assert_eq!(required("/customer/id"), Some(true));
        assert_eq!(required("/note"), Some(false));
        assert_eq!(required("/lines/0/sku"), Some(false));
        // What is found is described by the schema of the member, through `$ref`s.
        assert!(
            matches!(found("/customer/id"), Found::Yes { at, .. } if at == &json!({"type": "string"}))
        );
        assert_eq!(found("/extra/anything"), Found::CannotTell);
        assert!(matches!(found("/order_d"), Found::No { member, .. } if member == "order_d"));
        assert!(
            matches!(found("/customer/name"), Found::No { member, has } if member == "name" && has == ["id"])
        );
        // A schema that says nothing of its members cannot be held against the policy.
        assert_eq!(
            find(
                &json!({"type": "object"}),
                &json!({"type": "object"}),
                &path("/x"),
                0
            ),
            Found::CannotTell
        );
        let open = json!({"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}});
        assert_eq!(find(&open, &open, &path("/b"), 0), Found::CannotTell);
    }

    /// Whether a path holds an integer, through the shapes SDKs write; a schema that refers
    /// back to itself is followed only so deep.
    #[test]
    fn an_integer_is_seen_through_references_and_alternatives() {
        let root = json!({"$defs": {"Id": {"type": "integer"}}});
        for integer in [
            json!({"type": "integer"}),
            json!({"type": ["integer", "null"]}),
            json!({"anyOf": [{"type": "integer"}, {"type": "null"}]}),
            json!({"$ref": "#/$defs/Id"}),
        ] {
            assert!(admits_integer(&root, &integer), "{integer}");
        }
        for other in [
            json!({"type": "string"}),
            json!({}),
            json!({"type": "number"}),
        ] {
            assert!(!admits_integer(&root, &other), "{other}");
        }
        let looping = json!({"anyOf": [{"$ref": "#"}]});
        assert!(!admits_integer(&looping, &looping));
    }
}
