@echo off
rem Atelier for Windows: double-click this file to install (first time) and start the web UI.
rem From a terminal, arguments go on to launch.py: "launch.bat --doctor", "launch.bat --listen --port 7861".
setlocal
cd /d "%~dp0"
where py >nul 2>nul
if errorlevel 1 (
    python launch.py %*
) else (
    py -3 launch.py %*
)
set "RC=%ERRORLEVEL%"
if "%RC%"=="0" exit /b 0
if "%RC%"=="130" exit /b 130
echo.
echo Atelier stopped with an error (exit code %RC%); the messages above say why.
echo If Python is missing or older than 3.10: install Python 3.10 or newer from
echo https://www.python.org/downloads/ and tick "Add python.exe to PATH" in the installer,
echo then double-click launch.bat again. "launch.bat --doctor" shows what this PC has.
pause
exit /b %RC%
