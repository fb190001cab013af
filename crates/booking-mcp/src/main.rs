//! `booking-mcp`: an MCP server whose `book_slot` tool books a slot in the server's own database
//! at most once, guarded by once-ledger. The booking and a marker row naming its attempt commit
//! in one transaction (`once_client::local`); the ledger's `sql` reconciler reads the marker, so
//! a booking whose answer was lost is settled exactly, never guessed.
//!
//! Over stdio. Its database: `--database-url` (SQLite by default, or PostgreSQL).

use std::time::Duration;

use clap::Parser;
use futures::FutureExt as _;
use once_client::local::create_table;
use once_client::{mcp, ClientError, Effect, EffectError, LedgerClient, OperationSpec};
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, Implementation, ServerCapabilities, ServerConfig};
use rmcp::service::RequestContext;
use rmcp::{
    schemars, tool, tool_handler, tool_router, ErrorData, RoleServer, ServerHandler, ServiceExt,
};
use serde_json::json;

/// The marker table, which the ledger's `sql` reconciler is configured to read.
const MARKERS: &str = "once_effects";

/// The demo booking MCP server.
#[derive(Clone, Parser)]
#[command(name = "booking-mcp", version = once_telemetry::version())]
struct Args {
    #[command(flatten)]
    ledger: once_client::LedgerArgs,
    /// The server's own database, where bookings and their markers are written:
    /// `sqlite://PATH` (created if missing) or `postgres://USER@HOST/DB`.
    #[arg(
        long,
        env = "BOOKING_MCP_DATABASE",
        default_value = "sqlite://bookings.db?mode=rwc"
    )]
    database_url: String,
    /// The lease each booking attempt holds.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    lease_ttl: Duration,
    /// This instance's name, in the ledger's attempt log and in logs.
    #[arg(long, env = "BOOKING_MCP_INSTANCE", default_value = "booking-mcp")]
    instance: String,
    /// How log lines are written: text for people, or json (one object a line).
    #[arg(long, env = "ONCE_LOG_FORMAT", default_value = "text")]
    log_format: once_telemetry::LogFormat,
}

impl std::fmt::Debug for Args {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Args")
            .field("ledger", &self.ledger)
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

/// The server's database.
#[derive(Clone, Debug)]
enum Database {
    Postgres(sqlx::PgPool),
    Sqlite(sqlx::SqlitePool),
}

impl Database {
    async fn open(url: &str) -> anyhow::Result<Self> {
        let database = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Database::Postgres(sqlx::PgPool::connect(url).await?)
        } else {
            Database::Sqlite(sqlx::SqlitePool::connect(url).await?)
        };
        let postgres = matches!(database, Database::Postgres(_));
        for statement in [
            "CREATE TABLE IF NOT EXISTS bookings (slot TEXT PRIMARY KEY, who TEXT NOT NULL, booking_id TEXT NOT NULL)".to_owned(),
            create_table(MARKERS, postgres),
        ] {
            match &database {
                Database::Postgres(pool) => {
                    sqlx::query(&statement).execute(pool).await?;
                }
                Database::Sqlite(pool) => {
                    sqlx::query(&statement).execute(pool).await?;
                }
            }
        }
        Ok(database)
    }
}

#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct BookSlot {
    /// The slot to book, e.g. "2026-12-08T09:00/room-3".
    slot: String,
    /// Who it is booked for.
    who: String,
}

#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct BookingStatus {
    /// The slot whose booking to look up.
    slot: String,
}

#[derive(Clone)]
struct BookingServer {
    ledger: LedgerClient,
    database: Database,
    lease_ttl: Duration,
}

impl BookingServer {
    fn spec(&self, slot: &str, who: &str) -> OperationSpec {
        OperationSpec::new("book_slot", json!({ "slot": slot, "who": who }))
            .intent(["book", slot])
            .provider("bookings", json!({}))
            .lease_ttl(self.lease_ttl)
    }
}

/// The booking, written through the transaction's connection: its result names it.
macro_rules! book {
    ($slot:expr, $who:expr) => {
        |conn, context| {
            async move {
                let booking_id = format!("bk_{}", &context.provider_key[5..21]);
                sqlx::query("INSERT INTO bookings (slot, who, booking_id) VALUES ($1, $2, $3)")
                    .bind(&$slot)
                    .bind(&$who)
                    .bind(&booking_id)
                    .execute(conn)
                    .await
                    .map_err(|e| EffectError::NotPerformed(format!("the slot could not be booked: {e}")))?;
                let result = json!({ "slot": $slot, "who": $who, "booking_id": booking_id });
                Ok(Effect::new(result.to_string().into_bytes()).with_provider_ref(booking_id))
            }
            .boxed()
        }
    };
}

#[tool_router]
impl BookingServer {
    #[tool(
        description = "Book a slot for someone. Runs at most once per slot: calling it again returns the original booking.",
        annotations(
            destructive_hint = true,
            idempotent_hint = true,
            read_only_hint = false,
            open_world_hint = false
        )
    )]
    async fn book_slot(
        &self,
        Parameters(request): Parameters<BookSlot>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let spec = self
            .spec(&request.slot, &request.who)
            .context(mcp::attempt_context(&ctx));
        let (slot, who) = (request.slot, request.who);
        let outcome = match &self.database {
            Database::Postgres(pool) => {
                self.ledger
                    .run_local(&spec, pool, MARKERS, book!(slot, who))
                    .await
            }
            Database::Sqlite(pool) => {
                self.ledger
                    .run_local(&spec, pool, MARKERS, book!(slot, who))
                    .await
            }
        };
        Ok(match outcome {
            Ok(outcome) => mcp::tool_result(&outcome, "get_booking_status"),
            Err(error) => mcp::not_performed(&error),
        })
    }

    #[tool(
        description = "Look up what the ledger knows of a slot's booking: not requested, in progress, booked (with the booking), not performed, or being verified.",
        annotations(read_only_hint = true)
    )]
    async fn get_booking_status(
        &self,
        Parameters(request): Parameters<BookingStatus>,
    ) -> Result<CallToolResult, ErrorData> {
        let operation_id = self
            .spec(&request.slot, "")
            .operation_id()
            .map_err(|e| ErrorData::invalid_params(e.to_string(), None))?;
        let body = match self.ledger.get(&operation_id).await {
            Ok(found) => json!({
                "slot": request.slot,
                "operation_id": operation_id,
                "state": found.state.as_str(),
                "booking": found.result.and_then(|r| serde_json::from_slice::<serde_json::Value>(&r).ok()),
            }),
            Err(ClientError::NotFound) => json!({
                "slot": request.slot,
                "operation_id": operation_id,
                "state": "NOT_REQUESTED",
            }),
            Err(error) => return Ok(mcp::not_performed(&error)),
        };
        Ok(CallToolResult::success(vec![ContentBlock::text(
            body.to_string(),
        )]))
    }
}

#[tool_handler]
impl ServerHandler for BookingServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::from_build_env())
            .with_instructions(
                "Books slots at most once. If a booking is in progress or being verified, do not retry it: call get_booking_status.",
            )
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args: Args = once_telemetry::parse_args();
    let telemetry = match once_telemetry::Telemetry::init(once_telemetry::Process {
        name: "booking-mcp",
        log_format: args.log_format,
        prometheus: false,
    }) {
        Ok(telemetry) => telemetry,
        Err(error) => {
            eprintln!("booking-mcp: {}", once_telemetry::sentence(&error));
            return std::process::ExitCode::FAILURE;
        }
    };
    let code = match serve(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("booking-mcp stopped: {}", once_telemetry::sentence(&error));
            std::process::ExitCode::FAILURE
        }
    };
    telemetry.shutdown();
    code
}

async fn serve(args: Args) -> anyhow::Result<()> {
    let config = args.ledger.config(&args.instance)?;
    let ledger = args.ledger.client_with(config)?;
    let database = Database::open(&args.database_url).await?;
    let server = BookingServer {
        ledger,
        database,
        lease_ttl: args.lease_ttl,
    };
    tracing::info!("booking-mcp serving MCP over stdio");
    let running = server.serve(rmcp::transport::stdio()).await?;
    running.waiting().await?;
    Ok(())
}
