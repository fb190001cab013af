//! Tenants and credentials: what the `once.admin.v1.Admin` service and `onced keys …` /
//! `onced tenants …` do, written once.

use once_api::admin as convert;
use once_api::admin_pb as pb;
use once_core::access::{
    check_roles_for, check_tenant_name, ApiKey, Credential, CredentialKind, NewCredential, Role,
    Roles, SecretHash, Tenant,
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
    #[error("the ledger is closed: a credential exists, so every caller must present one")]
    Closed,
    #[error("the operating system gave no random bytes for a key")]
    NoRandomness(#[source] getrandom::Error),
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
    /// `by` says on whose word: a caller admitted while the ledger was open is refused
    /// ([`AdminError::Closed`]) once any credential exists, and of several at once, all but one.
    pub async fn create_key(
        &self,
        tenant: &str,
        name: &str,
        roles: Roles,
        certificate_pem: Option<&str>,
        by: Authority,
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
        check_roles_for(tenant, roles).map_err(|m| invalid("roles", m))?;
        let (new, key) = match certificate_pem {
            Some(pem) => {
                let der = CertificateDer::from_pem_slice(pem.as_bytes()).map_err(|e| {
                    invalid("certificate_pem", format!("not a PEM certificate: {e}"))
                })?;
                let secret_hash = SecretHash::of(der.as_ref());
                let key_id = format!("cert_{}", secret_hash.short_hex());
                (
                    NewCredential {
                        key_id,
                        tenant: tenant.to_owned(),
                        name: name.to_owned(),
                        roles,
                        kind: CredentialKind::Certificate,
                        secret_hash,
                        while_open: false,
                    },
                    None,
                )
            }
            None => {
                let key = generate()?;
                (new_key(&key, tenant, name, roles), Some(key))
            }
        };
        Ok((self.store_by(new, by).await?, key))
    }

    /// Stores `new` on the word of `by`. The operator's word (the CLI, the bootstrap file)
    /// stands even when the ledger closed meanwhile; an open ledger's caller's does not.
    async fn store_by(
        &self,
        mut new: NewCredential,
        by: Authority,
    ) -> Result<Credential, AdminError> {
        new.while_open = match by {
            Authority::OpenLedger => true,
            Authority::Operator => self.keys(None).await?.is_empty(),
        };
        match self.store(&new).await {
            Err(AdminError::Store(StoreError::Duplicate)) if new.while_open => {
                let stored = self.keys(None).await?;
                if stored.iter().any(|c| c.key_id == new.key_id) {
                    return Err(AdminError::Store(StoreError::Duplicate));
                }
                match by {
                    Authority::OpenLedger => Err(AdminError::Closed),
                    Authority::Operator => {
                        new.while_open = false;
                        self.store(&new).await
                    }
                }
            }
            stored => stored,
        }
    }

    /// Stores the bootstrap admin key, once: a key already stored (even revoked, and under
    /// whatever id it was given then) stays as it is, and `tenant` is created only if it does
    /// not exist.
    pub async fn bootstrap(&self, key: &ApiKey, tenant: &str) -> Result<(), AdminError> {
        let new = new_key(key, tenant, "bootstrap-admin", Roles::of([Role::Admin]));
        let stored = match self.store_by(new.clone(), Authority::Operator).await {
            Err(AdminError::NoTenant(_)) => {
                self.put_tenant(tenant, None, None).await?;
                self.store_by(new.clone(), Authority::Operator).await
            }
            stored => stored,
        };
        match stored {
            Ok(credential) => {
                tracing::info!(key_id = %credential.key_id, "bootstrap admin key stored");
                Ok(())
            }
            Err(AdminError::Store(StoreError::Duplicate)) => {
                let stored = self.backend.credentials_since(-1).await?.changed;
                let revoked = stored
                    .iter()
                    .find(|(hash, _, _)| *hash == new.secret_hash)
                    .map(|(_, credential, _)| credential)
                    .filter(|credential| credential.revoked_at.is_some());
                if let Some(credential) = revoked {
                    tracing::warn!(key_id = %credential.key_id, "the bootstrap admin key is revoked; it stays revoked");
                }
                Ok(())
            }
            Err(error) => Err(error),
        }
    }

    async fn store(&self, new: &NewCredential) -> Result<Credential, AdminError> {
        match self.backend.create_credential(new).await {
            Err(StoreError::NotFound) => Err(AdminError::NoTenant(new.tenant.clone())),
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
    getrandom::getrandom(&mut random).map_err(AdminError::NoRandomness)?;
    Ok(ApiKey::generate(random))
}

/// The record of an API key.
fn new_key(key: &ApiKey, tenant: &str, name: &str, roles: Roles) -> NewCredential {
    NewCredential {
        key_id: key.key_id(),
        tenant: tenant.to_owned(),
        name: name.to_owned(),
        roles,
        kind: CredentialKind::Key,
        secret_hash: key.hash(),
        while_open: false,
    }
}

/// On whose word a credential is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Authority {
    /// Whoever runs the ledger: the CLI on its database, the bootstrap key file.
    Operator,
    /// A caller the admin API admitted while no credential existed.
    OpenLedger,
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
        AdminError::Closed => status::unauthenticated("CREDENTIALS_MISSING", &error.to_string()),
        AdminError::Store(StoreError::Duplicate) => status::already_exists(
            "CREDENTIAL_EXISTS",
            "that certificate (or key) is already registered; revoke it to register it again under a new id",
        ),
        AdminError::NoRandomness(source) => {
            tracing::error!(error = %source, "no random bytes for a key");
            status::internal()
        }
        AdminError::Store(error) => status::store(error),
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
                convert::cap(req.max_in_flight),
                convert::cap(req.requests_per_second),
            )
            .await
            .map_err(refused)?;
        tracing::info!(tenant = %tenant.name, "tenant put");
        Ok(Response::new(convert::tenant(tenant)))
    }

    async fn list_tenants(
        &self,
        request: Request<pb::ListTenantsRequest>,
    ) -> Result<Response<pb::ListTenantsResponse>, Status> {
        self.access.admit(&request, Allowed::ADMIN).await?;
        let tenants = self.admin.tenants().await.map_err(refused)?;
        Ok(Response::new(convert::list_tenants_response(tenants)))
    }

    async fn create_key(
        &self,
        request: Request<pb::CreateKeyRequest>,
    ) -> Result<Response<pb::CreateKeyResponse>, Status> {
        let admin = self.access.admit(&request, Allowed::ADMIN).await?;
        let by = match admin.credential {
            Some(_) => Authority::Operator,
            None => Authority::OpenLedger,
        };
        let req = request.into_inner();
        let roles = convert::roles(&req.roles).map_err(status::invalid)?;
        let pem = Some(req.certificate_pem.as_str()).filter(|p| !p.is_empty());
        let (credential, key) = self
            .admin
            .create_key(&req.tenant, &req.name, roles, pem, by)
            .await
            .map_err(refused)?;
        self.access.changed();
        tracing::info!(
            key_id = %credential.key_id,
            tenant = %credential.tenant,
            roles = %credential.roles,
            by = ?admin.credential.as_ref().map(|c| &c.key_id),
            "credential created"
        );
        let secret = key.as_ref().map(|k| k.expose());
        Ok(Response::new(convert::create_key_response(
            credential, secret,
        )))
    }

    async fn list_keys(
        &self,
        request: Request<pb::ListKeysRequest>,
    ) -> Result<Response<pb::ListKeysResponse>, Status> {
        self.access.admit(&request, Allowed::ADMIN).await?;
        let req = request.into_inner();
        let tenant = Some(req.tenant.as_str()).filter(|t| !t.is_empty());
        let keys = self.admin.keys(tenant).await.map_err(refused)?;
        Ok(Response::new(convert::list_keys_response(keys)))
    }

    async fn revoke_key(
        &self,
        request: Request<pb::RevokeKeyRequest>,
    ) -> Result<Response<pb::Key>, Status> {
        let admin = self.access.admit(&request, Allowed::ADMIN).await?;
        let req = request.into_inner();
        let credential = self.admin.revoke(&req.key_id).await.map_err(refused)?;
        self.access.changed();
        tracing::info!(
            key_id = %credential.key_id,
            by = ?admin.credential.as_ref().map(|c| &c.key_id),
            "credential revoked"
        );
        Ok(Response::new(convert::key(credential)))
    }
}
