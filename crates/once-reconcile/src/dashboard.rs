//! A link from an operation to its provider's dashboard, for the people who check it there: a
//! reconciler's `dashboard` URL template in `--config`, with `{provider_key}` (the key the
//! effect was sent with) and `{provider_ref}` (the provider's id of it, once known), each
//! filled in percent-encoded. Only an `https://` or `http://` template is taken, so a link
//! shown in a page can only lead somewhere, never run anything.

/// A reconciler's dashboard link template, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dashboard {
    template: String,
}

impl Dashboard {
    /// The template, or what is wrong with it.
    pub fn parse(template: &str) -> Result<Self, String> {
        let scheme = template
            .split_once("://")
            .map(|(scheme, _)| scheme.to_ascii_lowercase());
        if !matches!(scheme.as_deref(), Some("https" | "http")) {
            return Err("must be an https:// (or http://) URL".to_owned());
        }
        if template
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '"' | '\'' | '<' | '>'))
        {
            return Err("must be one URL: no spaces, quotes or angle brackets".to_owned());
        }
        let mut rest = template;
        while let Some(open) = rest.find('{') {
            let close = rest[open..]
                .find('}')
                .ok_or("has a { without its }".to_owned())?;
            let name = &rest[open + 1..open + close];
            if !matches!(name, "provider_key" | "provider_ref") {
                return Err(format!(
                    "knows {{provider_key}} and {{provider_ref}}, not {{{name}}}"
                ));
            }
            rest = &rest[open + close + 1..];
        }
        Ok(Dashboard {
            template: template.to_owned(),
        })
    }

    /// The link for an operation whose effect was sent with `provider_key` and, once known, is
    /// `provider_ref` at the provider: `None` when the template needs a reference the operation
    /// does not have yet.
    pub fn link(&self, provider_ref: Option<&str>, provider_key: &str) -> Option<String> {
        let link = self
            .template
            .replace("{provider_key}", &percent_encoded(provider_key));
        if !link.contains("{provider_ref}") {
            return Some(link);
        }
        let reference = provider_ref.filter(|r| !r.is_empty())?;
        Some(link.replace("{provider_ref}", &percent_encoded(reference)))
    }
}

/// Every byte but the unreserved ones (RFC 3986) as `%XX`: safe in a path segment and in a
/// query value alike.
fn percent_encoded(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                out.push(char::from(byte))
            }
            _ => out.push_str(&format!("%{byte:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_fills_in_the_key_and_the_reference_percent_encoded() {
        let search = Dashboard::parse("https://dash.example/search?q={provider_key}").unwrap();
        assert_eq!(
            search.link(None, "once_ab&c=d").as_deref(),
            Some("https://dash.example/search?q=once_ab%26c%3Dd")
        );
        let refund = Dashboard::parse("https://dash.example/refunds/{provider_ref}").unwrap();
        assert_eq!(refund.link(None, "once_ab"), None, "no reference yet");
        assert_eq!(refund.link(Some(""), "once_ab"), None);
        assert_eq!(
            refund.link(Some("re_1/../x y"), "once_ab").as_deref(),
            Some("https://dash.example/refunds/re_1%2F..%2Fx%20y")
        );
    }

    #[test]
    fn only_a_web_url_with_known_placeholders_is_a_template() {
        for (template, said) in [
            ("javascript:alert(1)//{provider_key}", "https://"),
            ("JavaScript://x/{provider_key}", "https://"),
            ("data:text/html,<b>", "https://"),
            ("/relative/{provider_key}", "https://"),
            ("https://dash.example/\"onmouseover=x", "no spaces"),
            ("https://dash.example/ {provider_key}", "no spaces"),
            ("https://dash.example/{tenant}", "not {tenant}"),
            ("https://dash.example/{provider_key", "without its }"),
        ] {
            let refused = Dashboard::parse(template).unwrap_err();
            assert!(refused.contains(said), "{template}: {refused}");
        }
        assert!(Dashboard::parse("HTTPS://dash.example/{provider_ref}").is_ok());
    }
}
