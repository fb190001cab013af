//! Tenants and credentials: what the `once.admin.v1.Admin` service and `onced keys …` /
//! `onced tenants …` do, written once.

use once_api::admin_pb as pb;
use once_core::access::{
    check_tenant_name, ApiKey, Credential, CredentialKind, NewCredential, Roles, SecretHash, Tenant,
};
use once_store::{Backend, StoreError};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use tonic::{Request, Response, Status};

use crate::access::{Access, Allowed};
use crate::status;

/// Why an administrative change was refused.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("{field}: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    #[error("no tenant named {0:?}; create it first")]
    NoTenant(String),
    #[error("no credential with key id {0:?}")]
    NoKey(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

fn invalid(field: &'static str, message: impl Into<String>) -> AdminError {
    AdminError::Invalid {
        field,
        message: message.into(),
    }
}

/// The administrative operations over one store.
#[derive(Debug, Clone)]
pub struct Admin<B> {
    backend: B,
}

impl<B: Backend> Admin<B> {
    pub fn new(backend: B) -> Self {
        Self { backend }
    }

    /// Creates `name`, or sets its limits (`None`: no cap).
    pub async fn put_tenant(
        &self,
        name: &str,
        max_in_flight: Option<i64>,
        requests_per_second: Option<i64>,
    ) -> Result<Tenant, AdminError> {
        check_tenant_name(name).map_err(|m| invalid("name", m))?;
        for (field, value) in [
            ("max_in_flight", max_in_flight),
            ("requests_per_second", requests_per_second),
        ] {
            if value.is_some_and(|v| v <= 0) {
                return Err(invalid(field, "must be positive (or absent for no cap)"));
            }
        }
        Ok(self
            .backend
            .put_tenant(&Tenant {
                name: name.to_owned(),
                created_at: 0,
                max_in_flight,
                requests_per_second,
            })
            .await?)
    }

    pub async fn tenants(&self) -> Result<Vec<Tenant>, AdminError> {
        Ok(self.backend.tenants().await?)
    }

    /// Creates a key for `tenant` (returned this once), or registers a PEM client certificate.
    pub async fn create_key(
        &self,
        tenant: &str,
        name: &str,
        roles: Roles,
        certificate_pem: Option<&str>,
    ) -> Result<(Credential, Option<ApiKey>), AdminError> {
        check_tenant_name(tenant).map_err(|m| invalid("tenant", m))?;
        if name.is_empty() || name.len() > 128 || name.chars().any(char::is_control) {
            return Err(invalid(
                "name",
                "must be 1 to 128 characters, no control characters",
            ));
        }
        if roles.is_empty() {
            return Err(invalid("roles", "at least one role is needed"));
        }
        let (secret_hash, kind, key, key_id) = match certificate_pem {
            Some(pem) => {
                let der = CertificateDer::from_pem_slice(pem.as_bytes()).map_err(|e| {
                    invalid("certificate_pem", format!("not a PEM certificate: {e}"))
                })?;
                let hash = SecretHash::of(der.as_ref());
                (
                    hash,
                    CredentialKind::Certificate,
                    None,
                    format!("cert_{}", hash.short_hex()),
                )
            }
            None => {
                let key = generate()?;
                (
                    key.hash(),
                    CredentialKind::Key,
                    Some(key.clone()),
                    key.key_id(),
                )
            }
        };
        self.store(tenant, name, roles, kind, secret_hash, key_id)
            .await
            .map(|credential| (credential, key))
    }

    /// Stores the bootstrap admin key, once: a key already stored (even revoked) stays as it is.
    pub async fn bootstrap(&self, key: &ApiKey, tenant: &str) -> Result<(), AdminError> {
        if !self.tenants().await?.iter().any(|t| t.name == tenant) {
            self.put_tenant(tenant, None, None).await?;
        }
        let roles = Roles::of([once_core::access::Role::Admin]);
        match self
            .store(
                tenant,
                "bootstrap-admin",
                roles,
                CredentialKind::Key,
                key.hash(),
                key.key_id(),
            )
            .await
        {
            Ok(credential) => {
                tracing::info!(key_id = %credential.key_id, "bootstrap admin key stored");
                Ok(())
            }
            Err(AdminError::Store(StoreError::Duplicate)) => {
                if let Some((credential, _)) = self.backend.credential_by_hash(&key.hash()).await? {
                    if credential.revoked_at.is_some() {
                        tracing::warn!(key_id = %credential.key_id, "the bootstrap admin key is revoked; it stays revoked");
                    }
                }
                Ok(())
            }
            Err(error) => Err(error),
        }
    }

    async fn store(
        &self,
        tenant: &str,
        name: &str,
        roles: Roles,
        kind: CredentialKind,
        secret_hash: SecretHash,
        key_id: String,
    ) -> Result<Credential, AdminError> {
        let new = NewCredential {
            key_id,
            tenant: tenant.to_owned(),
            name: name.to_owned(),
            roles,
            kind,
            secret_hash,
        };
        match self.backend.create_credential(&new).await {
            Err(StoreError::NotFound) => Err(AdminError::NoTenant(tenant.to_owned())),
            other => Ok(other?),
        }
    }

    pub async fn keys(&self, tenant: Option<&str>) -> Result<Vec<Credential>, AdminError> {
        Ok(self.backend.credentials(tenant).await?)
    }

    pub async fn revoke(&self, key_id: &str) -> Result<Credential, AdminError> {
        self.backend
            .revoke_credential(key_id)
            .await?
            .ok_or_else(|| AdminError::NoKey(key_id.to_owned()))
    }
}

/// A new key from the operating system's random source.
fn generate() -> Result<ApiKey, AdminError> {
    let mut random = [0u8; 38];
    getrandom::getrandom(&mut random)
        .map_err(|e| invalid("secret", format!("no random source: {e}")))?;
    Ok(ApiKey::generate(random))
}

/// The `once.admin.v1.Admin` gRPC service.
#[derive(Debug)]
pub struct AdminService<B> {
    admin: Admin<B>,
    access: Access<B>,
}

impl<B: Backend> AdminService<B> {
    pub fn new(backend: B, access: Access<B>) -> Self {
        Self {
            admin: Admin::new(backend),
            access,
        }
    }
}

fn refused(error: AdminError) -> Status {
    match error {
        AdminError::Invalid { field, message } => {
            status::invalid(once_core::Invalid::new(field, message))
        }
        AdminError::NoTenant(_) => status::not_found("TENANT_NOT_FOUND", &error.to_string()),
        AdminError::NoKey(_) => status::not_found("KEY_NOT_FOUND", &error.to_string()),
        AdminError::Store(StoreError::Duplicate) => status::already_exists(
            "CREDENTIAL_EXISTS",
            "that certificate (or key) is already registered; revoke it to register it again under a new id",
        ),
        AdminError::Store(error) => status::store(error),
    }
}

fn cap(value: i64) -> Option<i64> {
    (value != 0).then_some(value)
}

pub fn tenant_to_pb(t: Tenant) -> pb::Tenant {
    pb::Tenant {
        name: t.name,
        created_at_ms: t.created_at,
        max_in_flight: t.max_in_flight.unwrap_or(0),
        requests_per_second: t.requests_per_second.unwrap_or(0),
    }
}

pub fn key_to_pb(c: Credential) -> pb::Key {
    pb::Key {
        key_id: c.key_id,
        tenant: c.tenant,
        name: c.name,
        roles: c.roles.iter().map(|r| r.to_string()).collect(),
        kind: c.kind.as_str().to_owned(),
        created_at_ms: c.created_at,
        revoked_at_ms: c.revoked_at.unwrap_or(0),
    }
}

#[tonic::async_trait]
impl<B: Backend> pb::admin_server::Admin for AdminService<B> {
    async fn put_tenant(
        &self,
        request: Request<pb::PutTenantRequest>,
    ) -> Result<Response<pb::Tenant>, Status> {
        self.access.admit(&request, Allowed::ADMIN).await?;
        let req = request.into_inner();
        let tenant = self
            .admin
            .put_tenant(
                &req.name,
                cap(req.max_in_flight),
                cap(req.requests_per_second),
            )
            .await
            .map_err(refused)?;
        tracing::info!(tenant = %tenant.name, "tenant put");
        Ok(Response::new(tenant_to_pb(tenant)))
    }

    async fn list_tenants(
        &self,
        request: Request<pb::ListTenantsRequest>,
    ) -> Result<Response<pb::ListTenantsResponse>, Status> {
        self.access.admit(&request, Allowed::ADMIN).await?;
        let tenants = self.admin.tenants().await.map_err(refused)?;
        Ok(Response::new(pb::ListTenantsResponse {
            tenants: tenants.into_iter().map(tenant_to_pb).collect(),
        }))
    }

    async fn create_key(
        &self,
        request: Request<pb::CreateKeyRequest>,
    ) -> Result<Response<pb::CreateKeyResponse>, Status> {
        let admin = self.access.admit(&request, Allowed::ADMIN).await?;
        let req = request.into_inner();
        let roles = Roles::of(
            req.roles
                .iter()
                .map(|r| r.parse())
                .collect::<Result<Vec<_>, String>>()
                .map_err(|m| refused(invalid("roles", m)))?,
        );
        let pem = Some(req.certificate_pem.as_str()).filter(|p| !p.is_empty());
        let (credential, key) = self
            .admin
            .create_key(&req.tenant, &req.name, roles, pem)
            .await
            .map_err(refused)?;
        tracing::info!(
            key_id = %credential.key_id,
            tenant = %credential.tenant,
            roles = %credential.roles,
            by = ?admin.credential.as_ref().map(|c| &c.key_id),
            "credential created"
        );
        Ok(Response::new(pb::CreateKeyResponse {
            key: Some(key_to_pb(credential)),
            secret: key.map(|k| k.expose().to_owned()).unwrap_or_default(),
        }))
    }

    async fn list_keys(
        &self,
        request: Request<pb::ListKeysRequest>,
    ) -> Result<Response<pb::ListKeysResponse>, Status> {
        self.access.admit(&request, Allowed::ADMIN).await?;
        let req = request.into_inner();
        let tenant = Some(req.tenant.as_str()).filter(|t| !t.is_empty());
        let keys = self.admin.keys(tenant).await.map_err(refused)?;
        Ok(Response::new(pb::ListKeysResponse {
            keys: keys.into_iter().map(key_to_pb).collect(),
        }))
    }

    async fn revoke_key(
        &self,
        request: Request<pb::RevokeKeyRequest>,
    ) -> Result<Response<pb::Key>, Status> {
        let admin = self.access.admit(&request, Allowed::ADMIN).await?;
        let req = request.into_inner();
        let credential = self.admin.revoke(&req.key_id).await.map_err(refused)?;
        tracing::info!(
            key_id = %credential.key_id,
            by = ?admin.credential.as_ref().map(|c| &c.key_id),
            "credential revoked"
        );
        Ok(Response::new(key_to_pb(credential)))
    }
}
