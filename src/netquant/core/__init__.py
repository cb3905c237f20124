"""netquant.core"""
