//! Checks a JSON object against a CRD's OpenAPI v3 schema: the types, the properties each object
//! may have (unknown ones only under x-kubernetes-preserve-unknown-fields or
//! additionalProperties), the required ones and array items. Enough to keep the objects a mocked
//! API serves in the shape the real CRD gives them.

use serde_json::Value;

/// The schema of `version` in the CRD file `path` (relative to the crate).
pub fn crd_schema(path: &str, version: &str) -> Value {
    let text = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap();
    let crd: Value = serde_yaml_ng::from_str(&text).unwrap();
    let versions = crd["spec"]["versions"].as_array().unwrap();
    let v = versions.iter().find(|v| v["name"] == version).unwrap_or_else(|| panic!("{version} in {path}"));
    v["schema"]["openAPIV3Schema"].clone()
}

/// Every way `value` departs from `schema`, as `path: why`.
pub fn violations(value: &Value, schema: &Value) -> Vec<String> {
    let mut out = Vec::new();
    walk(value, schema, "", &mut out);
    out
}

fn walk(value: &Value, schema: &Value, path: &str, out: &mut Vec<String>) {
    let fits = match schema["type"].as_str() {
        Some("object") => value.is_object(),
        Some("string") => value.is_string(),
        Some("integer") => value.is_i64() || value.is_u64(),
        Some("boolean") => value.is_boolean(),
        Some("array") => value.is_array(),
        _ => true,
    };
    if !fits {
        out.push(format!("{path}: {value} is not of type {}", schema["type"]));
        return;
    }
    if let Some(object) = value.as_object() {
        for key in schema["required"].as_array().into_iter().flatten().filter_map(Value::as_str) {
            if !object.contains_key(key) {
                out.push(format!("{path}: required field {key} is missing"));
            }
        }
        let open = schema["x-kubernetes-preserve-unknown-fields"] == true || path == ".metadata";
        for (key, field) in object {
            let at = format!("{path}.{key}");
            match schema["properties"].get(key) {
                Some(s) => walk(field, s, &at, out),
                None if schema["additionalProperties"].is_object() => {
                    walk(field, &schema["additionalProperties"], &at, out)
                }
                None if open => {}
                None => out.push(format!("{at}: not in the schema")),
            }
        }
    }
    if let (Some(items), Some(schema)) = (value.as_array(), schema.get("items")) {
        for (i, item) in items.iter().enumerate() {
            walk(item, schema, &format!("{path}[{i}]"), out);
        }
    }
}
